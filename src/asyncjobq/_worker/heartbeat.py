"""Extends locked_at for every job this worker holds, in one UPDATE per interval.

A job may therefore run for many multiples of the lease; only a worker that stops heartbeating
(dead, frozen, cut off) loses its jobs to the reaper.

The heartbeat runs in its own OS thread on its own connection, so a loop blocked for a moment
(`time.sleep` in an `async def`) does not cost the worker its jobs. The same thread watches the
loop's ticker and, while the loop is blocked, warns and names the code running on it.

A loop blocked for a whole lease stops the beats: its worker can no longer finish, cancel or
fence anything, and beats that went on would keep its jobs from the reaper for as long as the
block lasts, which may be forever (a loop spinning in a bug). The fleet then takes the jobs
back, as from a dead worker; if the loop returns, the beats resume and the lease machinery
(running.py, Running.cut_off and Running.lease_lost) lets go of the jobs whose lease lapsed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import psycopg

from .._db.database import Database
from ..errors import reason

log = logging.getLogger("asyncjobq.heartbeat")

TICK = 0.1  # how often the loop reports that it is alive

# Where a blocked loop's thread stands tells whose code blocks it (_blocker).
_EXECUTOR = str(Path(__file__).with_name("executor.py"))
_MAINTENANCE = str(Path(__file__).parent.parent / "_maintenance") + os.sep


Keys = list[tuple[int, int]]  # (job id, attempt)


class Heartbeat:
    def __init__(
        self,
        db: Database,
        worker_id: str,
        *,
        lease: float,
        renew: Callable[[], Keys],
        running_tasks: Callable[[], list[str]],
        on_lost: Callable[[set[tuple[int, int]]], None],
        on_cut_off: Callable[[float], None] = lambda _: None,
        on_cancel: Callable[[set[tuple[int, int]]], None] = lambda _: None,
    ) -> None:
        self._db = db
        self._worker_id = worker_id
        self._lease = lease
        self.interval = lease / 3
        # The (id, attempt) whose lease each beat extends (Running.leased); must be safe to
        # call from the heartbeat thread.
        self._renew = renew
        self._running_tasks = running_tasks  # likewise
        self._on_lost = on_lost  # called on the loop
        self._on_cut_off = on_cut_off  # likewise
        # Told of held attempts whose cancel was asked for (the fallback of the notification
        # Queue.cancel sends); on the loop as well.
        self._on_cancel = on_cancel
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._last_tick = time.monotonic()
        # When a beat last reached the database (or had nothing to renew, so nothing could lapse).
        # Not moved while the loop is stalled: the cut-off (_watch_lease) must then fire.
        self._last_ok = time.monotonic()
        self._errors_seen: set[str] = set()
        self._watch_errors_seen: set[str] = set()
        self._warned = False  # for the current block of the loop
        # The last tick before the loop stalled (blocked for a lease); None while it is not.
        self._stalled_from: float | None = None
        # One cut-off waits on a blocked loop, not one per TICK of the block.
        self._cut_off_pending = False
        self.beats = 0
        self.failures = 0
        self.blocked_warnings = 0
        self.stalls = 0  # times the beats stopped for a loop blocked a whole lease

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._last_tick = self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"asyncjobq-heartbeat-"
                                        f"{self._worker_id}", daemon=True)
        # The lease is watched apart from the beats: a beat may wait longer than a lease
        # where no bound of ours reaches (behind a pooler, a BEGIN queued for a server
        # connection), and the handlers must be let go at the lease all the same.
        self._watcher = threading.Thread(target=self._watch_run, name=f"asyncjobq-lease-"
                                         f"{self._worker_id}", daemon=True)
        self._watcher.start()
        try:
            self._thread.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._watcher):
            if thread is not None:
                thread.join(timeout=10)

    def _watch_run(self) -> None:
        while not self._stop.wait(TICK):
            self._watching(self._watch_lease)

    @property
    def alive(self) -> bool:
        return all(t is not None and t.is_alive() for t in (self._thread, self._watcher))

    async def tick(self) -> None:
        """Runs on the loop: proves to the heartbeat thread that the loop is not blocked."""
        while True:
            self._last_tick = time.monotonic()
            await asyncio.sleep(TICK)

    @property
    def stalled(self) -> bool:
        """The loop has been blocked for a lease: no beats are sent until it returns."""
        return self._stalled_from is not None

    def _run(self) -> None:
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        next_beat = time.monotonic() + self.interval
        pause = 0.0  # after a pass that raised: next_beat may be past, and wait(0) would spin
        try:
            while not self._stop.wait(
                    max(pause, min(TICK, max(0.0, next_beat - time.monotonic())))):
                pause = 0.0
                # Nothing may end this thread but stop(): a worker that kept claiming without
                # heartbeats would have every long job reaped and run twice.
                try:
                    was_stalled = self.stalled
                    # A bug in the watcher (a frame _blocker could not name raised on every
                    # pass) must not skip the beat below; the lease has its own thread.
                    self._watching(self._watch_loop)
                    if self.stalled:
                        next_beat = time.monotonic() + self.interval  # not a busy wait meanwhile
                        continue
                    if was_stalled:
                        next_beat = 0.0  # at once: every moment now lets the reaper take more
                    if time.monotonic() < next_beat:
                        continue
                    next_beat = time.monotonic() + self.interval
                    conn = self._beat(conn)
                except Exception as e:  # logged; the next beat tries again
                    self._failed(e)
                    _close(conn)
                    conn = None
                    pause = TICK
        finally:
            _close(conn)

    def _watching(self, watch: Callable[[], None]) -> None:
        try:
            watch()
        except Exception as e:  # a bug here; the beats go on regardless
            kind = type(e).__name__
            level = logging.DEBUG if kind in self._watch_errors_seen else logging.ERROR
            self._watch_errors_seen.add(kind)
            log.log(level, "heartbeat thread: %s failed (%s); heartbeats continue. This is a "
                    "bug in asyncjobq: please report it with this message.",
                    getattr(watch, "__name__", watch), reason(e), exc_info=True)

    def _watch_loop(self) -> None:
        # A lag under a lease leaves every lease intact (a beat lands every interval, and the
        # reaper takes only rows whose locked_at is older than a lease), so beats go on. At a
        # lease they stop: the last one landed less than an interval before, so job_reap_stuck
        # (_db/sql/maintenance.py) may take the jobs from 5/3 to 2 leases into the block, as
        # _watch_lease, counting from that same beat, cuts them off on this worker.
        lag = time.monotonic() - self._last_tick
        if lag < min(self._lease, max(1.0, self._lease * 0.2)):
            self._warned = False
            if self._stalled_from is not None:
                blocked = self._last_tick - self._stalled_from
                self._stalled_from = None
                log.warning(
                    "event loop running again after being blocked for %.1f s; heartbeats "
                    "resume. Handlers of jobs whose lease lapsed meanwhile are cancelled and "
                    "their outcomes refused: the fleet runs those jobs again.", blocked)
            return
        if lag >= self._lease:
            if self._stalled_from is None:
                where, advice = self._blocker()
                log.error(
                    "event loop blocked for %.1f s, a whole lease, by %s; running tasks: %s. "
                    "Heartbeats stop: this worker's jobs are no longer renewed, and the fleet "
                    "will reap them and run them again. %s",
                    lag, where, self._tasks(), advice)
                self._stalled_from = self._last_tick
                self.stalls += 1
            return
        if not self._warned:
            where, advice = self._blocker()
            log.warning(
                "event loop blocked for %.1f s by %s; running tasks: %s. Heartbeats continue "
                "until it has been blocked for a lease (%.1f s); then this worker's jobs are "
                "reaped and run again. %s",
                lag, where, self._tasks(), self._lease, advice)
            self._warned = True
            self.blocked_warnings += 1

    def _tasks(self) -> str:
        return ", ".join(sorted(set(self._running_tasks()))) or "none"

    def _blocker(self) -> tuple[str, str]:
        """Whose code holds the loop's thread, where (innermost frames first), and what to do.

        Never raises: it runs on every pass of the heartbeat thread while the loop is blocked,
        and the frames it reads are anyone's code (any filename, any shape)."""
        try:
            return self._locate()
        except Exception:
            log.debug("could not name the code blocking the event loop", exc_info=True)
            return "code that could not be located", ""

    def _locate(self) -> tuple[str, str]:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "code that could not be located", ""
        # Outermost first, as extract_stack gives it; no source lines read from disk.
        stack = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=200,
                                               lookup_lines=False)
        stack.reverse()
        del frame  # a frame of another thread kept alive here would pin its locals
        attempts = [i for i, f in enumerate(stack)
                    if f.filename == _EXECUTOR and f.name == "_attempt"]
        if attempts:
            # The executor's own frames (_run, _call) only say that a job runs; past them, the
            # outermost frame is the handler (or its middleware), named if not among those shown.
            inner = [f for f in stack[attempts[-1]:] if f.filename != _EXECUTOR] or stack[-1:]
            where = _frames(inner)
            if len(inner) > 3:
                where += f", within {inner[0].name} ({_short(inner[0].filename)}:" \
                         f"{inner[0].lineno})"
            return (f"a job's handler at {where}",
                    "Make the handler await (asyncio.sleep, async clients), or define it with "
                    "plain `def` so that it runs in a thread.")
        if stack and stack[-1].name == "select" and stack[-1].filename.endswith("selectors.py"):
            return ("nothing: the loop waited for I/O, so the whole process was paused or "
                    "starved of CPU", "Check the host (CPU limits, a suspended process or VM).")
        if any(f.filename.startswith(_MAINTENANCE) for f in stack):
            return (f"asyncjobq's maintenance code at {_frames(stack)}",
                    "This is a bug in asyncjobq: please report it with this message.")
        return (f"code running on the loop at {_frames(stack)}",
                "Move blocking work off the loop (asyncio.to_thread) or make it await.")

    def _watch_lease(self) -> None:
        silent = time.monotonic() - self._last_ok
        if silent < self._lease or self._loop is None or self._cut_off_pending:
            return
        # Every pass (each TICK) while the loop runs: a job whose lease lapses between passes
        # is let go within a TICK, not an interval later while another worker may already run
        # it. The loop's handler skips what it has already cancelled.
        self._cut_off_pending = True
        try:
            self._loop.call_soon_threadsafe(self._cut_off_on_loop, silent)
        except RuntimeError:
            self._cut_off_pending = False  # loop closed: the worker is gone anyway

    def _cut_off_on_loop(self, silent: float) -> None:
        self._cut_off_pending = False
        self._on_cut_off(max(silent, time.monotonic() - self._last_ok))

    def _connect(self) -> psycopg.Connection[tuple[object, ...]]:
        # Every beat is bounded in time: a connection the network dropped silently would
        # otherwise block a beat for the kernel's retransmission timeout (~15 min) while the
        # fleet reaps and reruns this worker's long jobs.
        bound = self._bound
        conn = psycopg.connect(
            self._db.dsn, autocommit=True, connect_timeout=max(2, int(bound)),
            application_name=f"{self._db.application_name}-heartbeat",
            **self._db.connect_options(keepalives_idle=max(1, int(bound)),
                                       keepalives_interval=1, tcp_user_timeout=int(bound * 1000)))
        if self._db.pooled:
            return conn  # no session setting behind a pooler: each beat sets its own (_send)
        try:
            conn.execute(self._db.sql.session_statement_timeout, (self._statement_timeout,))
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def _bound(self) -> float:
        """The most a beat's connect, send or statement may take, in seconds."""
        return max(1.0, self.interval)

    @property
    def _statement_timeout(self) -> str:
        return f"{int(self._bound * 1000)}ms"

    def _send(self, conn: psycopg.Connection[tuple[object, ...]],
              params: dict[str, object]) -> list[tuple[object, ...]]:
        if not self._db.pooled:
            return conn.execute(self._db.sql.job_heartbeat_many, params).fetchall()
        # Behind a transaction pooler the bound is the transaction's own (SET LOCAL): three
        # more round trips a beat (BEGIN, the setting, COMMIT), every interval. A BEGIN
        # queued in the pooler for a server connection is bounded by the pooler only
        # (query_wait_timeout); the lease is watched apart (_watch_run) meanwhile.
        with conn.transaction():
            conn.execute(self._db.sql.local_statement_timeout, (self._statement_timeout,))
            return conn.execute(self._db.sql.job_heartbeat_many, params).fetchall()

    def _held(self, conn: psycopg.Connection[tuple[object, ...]], leased: Keys,
              ) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
        """The attempts of `leased` still this worker's, their leases extended, and those of
        them whose cancel was asked for."""
        rows = self._send(conn, {
            "ids": [i for i, _ in leased], "attempts": [a for _, a in leased],
            "worker": self._worker_id})
        kept = {(int(r[0]), int(r[1])) for r in rows}  # type: ignore[call-overload]
        cancel = {(int(r[0]), int(r[1])) for r in rows if r[2]}  # type: ignore[call-overload]
        return kept, cancel

    def _beat(
        self, conn: psycopg.Connection[tuple[object, ...]] | None
    ) -> psycopg.Connection[tuple[object, ...]] | None:
        leased = self._renew()
        if not leased:
            self._last_ok = time.monotonic()
            return conn
        sent = time.monotonic()
        try:
            if conn is None or conn.closed:
                conn = self._connect()
            kept, cancel = self._held(conn, leased)
            # Not found: written meanwhile (an outcome pending when the beat began), reaped,
            # or a row the leader's rotation moved while this beat waited for it, whose
            # locked version was deleted and whose moved one is newer than the snapshot
            # (docs/how-it-works/storage.md). Only the attempts still leased now are looked
            # for again.
            again = [k for k in leased if k not in kept]
            if again:
                still = set(self._renew())
                again = [k for k in again if k in still]
        except psycopg.Error as e:
            self._failed(e)
            _close(conn)
            return None
        self._last_ok = sent
        self._errors_seen.clear()
        self.beats += 1
        lost: set[tuple[int, int]] = set()
        # A statement of its own sees the move. Not sent once the beat has taken half its
        # bound, and its failure loses nothing the first statement renewed: the next beat
        # looks for those attempts.
        if again and time.monotonic() - sent < self._bound / 2:
            try:
                found, cancel_found = self._held(conn, again)
                lost = set(again) - found
                cancel |= cancel_found
            except psycopg.Error as e:
                log.debug("heartbeat: %d attempt(s) not looked for again (%s)", len(again),
                          reason(e))
                _close(conn)
                conn = None
        if (lost or cancel) and self._loop is not None:
            try:
                if lost:
                    self._loop.call_soon_threadsafe(self._lost_on_loop, lost)
                if cancel:
                    self._loop.call_soon_threadsafe(self._on_cancel, cancel)
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
        # Only attempts still leased now were lost; the others finished while the UPDATE ran.
        lost &= set(self._renew())
        if lost:
            self._on_lost(lost)

    async def beat(self) -> None:
        """One heartbeat now, from the loop (tests and diagnostics)."""
        await asyncio.to_thread(self._beat_once)

    def _beat_once(self) -> None:
        _close(self._beat(None))


def _frames(stack: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """'dir/file.py:12 in f (called from ...)': the innermost frame and its two callers."""
    shown = [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in reversed(stack[-3:])]
    if not shown:
        return "an unknown place"
    return shown[0] + (f" (called from {', '.join(shown[1:])})" if shown[1:] else "")


def _short(filename: str) -> str:
    """The file's directory and name: 'dir/file.py'. Any filename, as compile() accepts any:
    "" (whose parts are none), "<string>", "<frozen ...>", relative ones."""
    parts = Path(filename).parts[-2:]
    return os.path.join(*parts) if parts else f"{filename!r}"


def _close(conn: psycopg.Connection[tuple[object, ...]] | None) -> None:
    if conn is not None:
        conn.close()
