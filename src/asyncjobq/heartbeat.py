"""Extends locked_at for every job this worker holds, in one UPDATE per interval.

A job may therefore run for many multiples of the lease; only a worker that stops heartbeating
(dead, frozen, cut off) loses its jobs to the reaper.

The heartbeat runs in its own OS thread on its own connection: a handler that blocks the event
loop (`time.sleep` in an `async def`) cannot starve it. The same thread watches the loop's
ticker and, while the loop is blocked, warns and names the tasks that were running.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import psycopg

from .errors import reason
from .queue import Queue

log = logging.getLogger("asyncjobq.worker")

TICK = 0.1  # how often the loop reports that it is alive


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
        self._held_ids = held_ids  # must be safe to call from the heartbeat thread
        self._running_tasks = running_tasks  # likewise
        self._on_lost = on_lost  # called on the loop
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = time.monotonic()
        self.beats = 0
        self.blocked_warnings = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._last_tick = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"asyncjobq-heartbeat-"
                                        f"{self._worker_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def tick(self) -> None:
        """Runs on the loop: proves to the heartbeat thread that the loop is not blocked."""
        while True:
            self._last_tick = time.monotonic()
            await asyncio.sleep(TICK)

    def _run(self) -> None:
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        next_beat = time.monotonic() + self.interval
        blocked_since: float | None = None
        try:
            while not self._stop.wait(min(TICK, max(0.0, next_beat - time.monotonic()))):
                blocked_since = self._watch_loop(blocked_since)
                if time.monotonic() < next_beat:
                    continue
                next_beat = time.monotonic() + self.interval
                conn = self._beat(conn)
        finally:
            if conn is not None:
                conn.close()

    def _watch_loop(self, blocked_since: float | None) -> float | None:
        lag = time.monotonic() - self._last_tick
        if lag < max(1.0, self._lease * 0.2):
            return None
        if blocked_since is None:
            self.blocked_warnings += 1
            tasks = sorted(set(self._running_tasks()))
            log.warning(
                "event loop blocked for %.1f s (lease %.1f s); running tasks: %s. A handler is "
                "blocking the loop: make it await, or define it with plain `def` so it runs in "
                "a thread. Heartbeats continue from their own thread.",
                lag, self._lease, ", ".join(tasks) or "none")
            return time.monotonic()
        return blocked_since

    def _beat(
        self, conn: psycopg.Connection[tuple[object, ...]] | None
    ) -> psycopg.Connection[tuple[object, ...]] | None:
        ids = self._held_ids()
        if not ids:
            return conn
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(self._queue.dsn, autocommit=True, connect_timeout=10,
                                       application_name=f"{self._queue.application_name}"
                                                        "-heartbeat")
            cur = conn.execute(self._queue.sql.job_heartbeat_many,
                               {"ids": ids, "worker": self._worker_id})
            kept = {int(r[0]) for r in cur.fetchall()}  # type: ignore[call-overload]
        except psycopg.Error as e:
            log.warning("heartbeat failed (%s); jobs will be reaped if this lasts %.0f s",
                        reason(e),
                        self._lease)
            if conn is not None:
                conn.close()
            return None
        self.beats += 1
        lost = set(ids) - kept
        if lost and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._lost_on_loop, lost)
            except RuntimeError:
                pass  # loop closed: the worker is gone anyway
        return conn

    def _lost_on_loop(self, lost: set[int]) -> None:
        # Only ids still held now were lost; the others finished while the UPDATE ran.
        lost &= set(self._held_ids())
        if lost:
            self._on_lost(lost)

    async def beat(self) -> None:
        """One heartbeat now, from the loop (tests and diagnostics)."""
        await asyncio.to_thread(self._beat_once)

    def _beat_once(self) -> None:
        conn = self._beat(None)
        if conn is not None:
            conn.close()
