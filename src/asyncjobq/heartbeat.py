"""Extends locked_at for every job this worker holds, in one UPDATE per interval.

A job may therefore run for many multiples of the lease; only a worker that stops heartbeating
(dead, frozen, cut off) loses its jobs to the reaper. The same loop measures its own lateness:
when the event loop was blocked for a good part of the lease, it warns and names the tasks
that were running, since one of them is the likely culprit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import psycopg
from psycopg_pool import PoolTimeout

from .queue import Queue

log = logging.getLogger("asyncjobq.worker")


class Heartbeat:
    def __init__(
        self,
        queue: Queue,
        worker_id: str,
        *,
        lease: float,
        held_ids: Callable[[], list[int]],
        running_tasks: Callable[[], list[str]],
        on_lost: Callable[[set[int]], None],
    ) -> None:
        self._queue = queue
        self._worker_id = worker_id
        self._lease = lease
        self.interval = lease / 3
        self._held_ids = held_ids
        self._running_tasks = running_tasks
        self._on_lost = on_lost
        self.beats = 0

    async def run(self) -> None:
        while True:
            expected = time.monotonic() + self.interval
            await anyio.sleep(self.interval)
            lag = time.monotonic() - expected
            if lag > self._lease * 0.2:
                tasks = sorted(set(self._running_tasks()))
                log.warning(
                    "event loop was blocked for %.1f s (lease %.1f s); running tasks: %s. A "
                    "handler is blocking the loop: make it async, or define it with plain `def` "
                    "so it runs in a thread", lag, self._lease, ", ".join(tasks) or "none")
            try:
                await self.beat()
            except (psycopg.OperationalError, PoolTimeout) as e:
                log.warning("heartbeat failed (%s); jobs may be reaped if this lasts %.0f s",
                            str(e).strip().splitlines()[0] if str(e).strip() else e, self._lease)

    async def beat(self) -> None:
        ids = self._held_ids()
        if not ids:
            return
        async with self._queue.connection() as conn:
            cur = await conn.execute(
                self._queue.sql.job_heartbeat_many, {"ids": ids, "worker": self._worker_id}
            )
            kept = {int(r[0]) for r in await cur.fetchall()}
        self.beats += 1
        # Only ids still held after the UPDATE were lost; the others finished meanwhile.
        lost = set(ids) - kept
        lost &= set(self._held_ids())
        if lost:
            self._on_lost(lost)
