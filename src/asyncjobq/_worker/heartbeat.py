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

from .._db.database import Database
from ..errors import reason

log = logging.getLogger("asyncjobq.heartbeat")

TICK = 0.1  # how often the loop reports that it is alive


Held = list[tuple[int, int]]  # (job id, attempt)


class Heartbeat:
    def __init__(
        self,
        db: Database,
        worker_id: str,
        *,
        lease: float,
        held: Callable[[], Held],
        running_tasks: Callable[[], list[str]],
        on_lost: Callable[[set[tuple[int, int]]], None],
        on_cut_off: Callable[[float], None] = lambda _: None,
    ) -> None:
        self._db = db
        self._worker_id = worker_id
        self._lease = lease
        self.interval = lease / 3
        self._held = held  # must be safe to call from the heartbeat thread
        self._running_tasks = running_tasks  # likewise
        self._on_lost = on_lost  # called on the loop
        self._on_cut_off = on_cut_off  # likewise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_tick = time.monotonic()
        # When a beat last reached the database (or nothing was held, so nothing could lapse).
        self._last_ok = time.monotonic()
        self._errors_seen: set[str] = set()
        self.beats = 0
        self.failures = 0
        self.blocked_warnings = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._last_tick = self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"asyncjobq-heartbeat-"
                                        f"{self._worker_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
                # Nothing may end this thread but stop(): a worker that kept claiming without
                # heartbeats would have every long job reaped and run twice.
                try:
                    blocked_since = self._watch_loop(blocked_since)
                    self._watch_lease()
                    if time.monotonic() < next_beat:
                        continue
                    next_beat = time.monotonic() + self.interval
                    conn = self._beat(conn)
                except Exception as e:  # logged; the next beat tries again
                    self._failed(e)
                    _close(conn)
                    conn = None
        finally:
            _close(conn)

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

    def _watch_lease(self) -> None:
        silent = time.monotonic() - self._last_ok
        if silent < self._lease or self._loop is None:
            return
        # Every pass (each TICK): a job whose lease lapses between passes is let go within a
        # TICK, not an interval later while another worker may already run it. The loop's
        # handler skips what it has already cancelled.
        try:
            self._loop.call_soon_threadsafe(self._on_cut_off, silent)
        except RuntimeError:
            pass  # loop closed: the worker is gone anyway

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        # Every beat is bounded in time: a connection the network dropped silently would
        # otherwise block a beat for the kernel's retransmission timeout (~15 min) while the
        # fleet reaps and reruns this worker's long jobs.
        bound = max(1.0, self.interval)
        conn = psycopg.connect(
            self._db.dsn, autocommit=True, connect_timeout=max(2, int(bound)),
            application_name=f"{self._db.application_name}-heartbeat",
            keepalives=1, keepalives_idle=max(1, int(bound)), keepalives_interval=1,
            keepalives_count=3, tcp_user_timeout=int(bound * 1000))
        try:
            conn.execute(self._db.sql.session_statement_timeout, (f"{int(bound * 1000)}ms",))
        except BaseException:
            conn.close()
            raise
        return conn

    def _beat(
        self, conn: psycopg.Connection[tuple[object, ...]] | None
    ) -> psycopg.Connection[tuple[object, ...]] | None:
        held = self._held()
        if not held:
            self._last_ok = time.monotonic()
            return conn
        sent = time.monotonic()
        try:
            if conn is None or conn.closed:
                conn = self._connect()
            cur = conn.execute(self._db.sql.job_heartbeat_many, {
                "ids": [i for i, _ in held], "attempts": [a for _, a in held],
                "worker": self._worker_id})
            kept = {(int(r[0]), int(r[1])) for r in cur.fetchall()}  # type: ignore[call-overload]
        except psycopg.Error as e:
            self._failed(e)
            _close(conn)
            return None
        self._last_ok = sent
        self._errors_seen.clear()
        self.beats += 1
        lost = set(held) - kept
        if lost and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._lost_on_loop, lost)
            except RuntimeError:
                pass  # loop closed: the worker is gone anyway
        return conn

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        kind = type(e).__name__
        level = logging.DEBUG if kind in self._errors_seen else logging.WARNING
        self._errors_seen.add(kind)
        log.log(level, "heartbeat failed (%s); this worker's jobs will be reaped, and its "
                "handlers cancelled, if no heartbeat lands for %.0f s", reason(e), self._lease,
                exc_info=not isinstance(e, psycopg.Error))

    def _lost_on_loop(self, lost: set[tuple[int, int]]) -> None:
        # Only attempts still held now were lost; the others finished while the UPDATE ran.
        lost &= set(self._held())
        if lost:
            self._on_lost(lost)

    async def beat(self) -> None:
        """One heartbeat now, from the loop (tests and diagnostics)."""
        await asyncio.to_thread(self._beat_once)

    def _beat_once(self) -> None:
        _close(self._beat(None))


def _close(conn: psycopg.Connection[tuple[object, ...]] | None) -> None:
    if conn is not None:
        conn.close()
