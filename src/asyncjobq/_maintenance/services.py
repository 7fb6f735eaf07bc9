"""Maintenance services and the one runner that runs them
(docs/how-it-works/architecture.md).

A service is a small object of one shape: a `name`, an `interval` in seconds, `leader_only`
(run on the fleet's leader only, leader.py), a `timeout` in seconds, `async turn()` and,
for a service that must not wait behind handlers for a pooled connection, `held` (a connection
of its own, open while the runner runs; heldconn.py). The
runner calls each turn every interval, cancels a turn that outlasts its timeout, logs and backs
off when a turn fails, and never dies of a failed turn: a bug in one service (even one that
raises CancelledError of its own) must not stop a worker's claims, nor the other services. A
service that sets `disabled` is not run again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack

import anyio
import psycopg
from psycopg_pool import PoolTimeout

from .._db import retrying
from .._db.database import Database
from .._db.heldconn import HeldConnection
from ..errors import reason

log = logging.getLogger("asyncjobq.services")

MAX_BACKOFF = 60.0


class TurnTimeout(Exception):
    """A turn outlasted its service's timeout."""


class Service:
    name = "service"
    interval = 1.0
    leader_only = False
    disabled = False
    # Run the first turn at once rather than after one interval.
    eager = False
    # Failed turns back off up to this (the elector must keep trying every interval).
    max_backoff = MAX_BACKOFF
    # A turn still running after this is cancelled and counted as failed: a turn stuck on a
    # lock or a server that stopped answering must not hold the service for good.
    timeout = 60.0
    # A connection of the service's own while the runner runs (else it uses the pool).
    held: HeldConnection | None = None

    async def turn(self) -> object:
        raise NotImplementedError

    def own_connection(self, db: Database, role: str) -> HeldConnection:
        """Give the service a connection of its own (`held`), for its statements to use; it
        plans them as the pool's connections do."""
        held = self.held = HeldConnection(db, role, generic_plans=False)
        return held


class ServiceRunner:
    def __init__(self, services: Sequence[Service], *,
                 is_leader: Callable[[], bool] = lambda: True) -> None:
        self.services = list(services)
        self._is_leader = is_leader
        self.failures: dict[str, int] = {}
        self._scope = anyio.CancelScope()
        self._started = False
        self._ended = anyio.Event()

    async def run(self) -> None:
        self._started = True
        try:
            with self._scope:
                async with AsyncExitStack() as held:
                    for service in self.services:
                        if service.held is not None:
                            await held.enter_async_context(service.held)
                    async with anyio.create_task_group() as tg:
                        for service in self.services:
                            tg.start_soon(self._loop, service,
                                          name=f"asyncjobq service {service.name}")
        finally:
            self._ended.set()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def stop(self) -> None:
        """Cancel every turn and wait until none runs (before the leader resigns: a turn of
        the elector still in flight could write the row back)."""
        self._scope.cancel()
        if self._started:
            await self._ended.wait()

    async def _loop(self, service: Service) -> None:
        delay = 0.0 if service.eager else service.interval
        failed_kinds: set[str] = set()
        while not service.disabled:
            await anyio.sleep(delay)
            delay = service.interval
            if service.leader_only and not self._is_leader():
                if service.held is not None:
                    await service.held.close()  # a former leader's: reopened if it leads again
                continue
            try:
                with anyio.move_on_after(service.timeout) as scope:
                    await service.turn()
                if scope.cancelled_caught:
                    raise TurnTimeout(f"the turn took more than {service.timeout:g} s and was "
                                      "cancelled")
            except (psycopg.Error, PoolTimeout, OSError, TurnTimeout) as e:
                delay = self._failed(service, e, failed_kinds, traceback=False)
            except asyncio.CancelledError as e:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the runner itself is being stopped
                delay = self._failed(service, e, failed_kinds, traceback=True)
            except Exception as e:  # a bug: logged with its traceback, the worker goes on
                delay = self._failed(service, e, failed_kinds, traceback=True)
            else:
                failed_kinds.clear()
                self.failures[service.name] = 0

    def _failed(self, service: Service, e: BaseException, seen: set[str], *,
                traceback: bool) -> float:
        n = self.failures[service.name] = self.failures.get(service.name, 0) + 1
        delay = max(service.interval,
                    min(service.max_backoff, service.interval * 2.0 ** min(n, 6)))
        kind = retrying.kind(e)
        # Once per kind of error until a turn succeeds: an outage must not flood the log.
        level = logging.DEBUG if kind in seen else logging.WARNING
        seen.add(kind)
        if isinstance(e, TurnTimeout):
            advice = (": look for locks held on the queue's tables (pg_locks) or a server that "
                      "stopped answering")
        else:
            advice = "" if traceback else f": {retrying.advice(e)}"
        log.log(level, "%s turn failed (%s)%s; trying again in %.1f s", service.name, reason(e),
                advice, delay, exc_info=traceback)
        return delay
