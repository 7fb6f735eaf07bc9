"""Maintenance services and the one runner that runs them
(docs/how-it-works/architecture.md).

A service is a small object of one shape: a `name`, an `interval` in seconds, `leader_only`
(run on the fleet's leader only, leader.py), a `timeout` in seconds, `async turn()` and,
for a service that must not wait behind handlers for a pooled connection, `own_connection` (a
connection of its own, open while the runner runs; ownconn.py). The runner calls each turn
every interval, cancels a turn that outlasts its timeout, logs and backs off when a turn fails
(`turn_backoff`), and never dies of a failed turn: a bug in one service (even one that raises
CancelledError of its own) must not stop a worker's claims, nor the other services. A service
that sets `disabled` is not run again.
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
from .._db.ownconn import OwnConnection
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
    own_connection: OwnConnection | None = None

    async def turn(self) -> object:
        raise NotImplementedError

    def use_own_connection(self, db: Database, role: str) -> OwnConnection:
        """Give the service a connection of its own (`own_connection`), for its statements to
        use; it plans them as the pool's connections do."""
        conn = self.own_connection = OwnConnection(db, role, generic_plans=False)
        return conn


def turn_backoff(service: Service) -> retrying.Backoff:
    """The waits after failed turns in a row: 2, 4, ... 64 intervals, at most `max_backoff`
    but never less than one interval (the elector's `max_backoff` is its interval)."""
    most = max(service.interval, min(service.max_backoff, 64 * service.interval))
    return retrying.Backoff(2 * service.interval, most)


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
                async with AsyncExitStack() as opened:
                    for service in self.services:
                        if service.own_connection is not None:
                            await opened.enter_async_context(service.own_connection)
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
        backoff = turn_backoff(service)
        failed_kinds: set[str] = set()
        while not service.disabled:
            await anyio.sleep(delay)
            delay = service.interval
            if service.leader_only and not self._is_leader():
                if service.own_connection is not None:
                    # A former leader's: reopened if it leads again.
                    await service.own_connection.close()
                continue
            try:
                with anyio.move_on_after(service.timeout) as scope:
                    await service.turn()
                if scope.cancelled_caught:
                    raise TurnTimeout(f"the turn took more than {service.timeout:g} s and was "
                                      "cancelled")
            except (psycopg.Error, PoolTimeout, OSError, TurnTimeout) as e:
                delay = self._failed(service, e, backoff, failed_kinds, traceback=False)
            except asyncio.CancelledError as e:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the runner itself is being stopped
                delay = self._failed(service, e, backoff, failed_kinds, traceback=True)
            except Exception as e:  # a bug: logged with its traceback, the worker goes on
                delay = self._failed(service, e, backoff, failed_kinds, traceback=True)
            else:
                backoff.reset()
                failed_kinds.clear()
                self.failures[service.name] = 0

    def _failed(self, service: Service, e: BaseException, backoff: retrying.Backoff,
                seen: set[str], *, traceback: bool) -> float:
        self.failures[service.name] = self.failures.get(service.name, 0) + 1
        delay = backoff.next()
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
