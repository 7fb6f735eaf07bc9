"""The periodic scheduler: a leader-only maintenance service (services.py) that enqueues each
schedule's ticks (periodic.py) exactly once per fleet.

Each turn (every second) reads every schedule's latest recorded tick and the server's clock in
one statement, computes the due ticks, and writes them with their jobs in one more statement
(sql/maintenance.py: periodic_ticks_enqueue), guarded by the primary key of `periodic_ticks`.
Nothing is kept in memory that decides what to enqueue: a leader change or a restart goes on
from the database.

- Ticks are written up to `ahead` seconds before they are due, with `run_at` at the tick's
  time: workers are woken for that instant (the insert trigger's NOTIFY carries it), so a
  tick runs on time although the scheduler turns only once a second.
- Ticks missed for less than `grace` (the worker passes two leases: a leader change, a slow
  turn, a quick restart) are all enqueued late. After a longer gap (no worker ran), only the
  latest missed tick is enqueued, or, with `catch_up=True`, all of them up to MAX_CATCH_UP.
- A new schedule (no row yet) starts from now: its first turn records where it starts.
- A schedule removed from the code is no longer read, so it stops; its latest row stays.
- One schedule that cannot be computed or written (a bug, a constraint or trigger of the
  operator's on jobs) is logged and skipped: the other schedules' ticks are written without it.
- A latest tick far past the server's clock means the clock was set back: the schedule would
  wait, silently, until the clock caught up. The rows past the clock are deleted (a warning
  says so) and the schedule goes on from the clock.
- The leader's code decides which schedules exist: during a rolling deploy the schedules of
  whichever version holds the lease are run, until leadership moves to the new version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

import anyio
import anyio.to_thread
import psycopg

from .._db.database import Database
from ..schedule import Schedule
from .services import Service

log = logging.getLogger("asyncjobq.scheduler")

INTERVAL = 1.0
# Enqueue ticks due within this: more than one interval, so a turn that runs late still
# enqueues a tick before it is due.
AHEAD = 2.0
MAX_CATCH_UP = 100
# Rows older than this are deleted, except each schedule's latest. The primary key needs
# only the rows a turn in flight could write again (a turn is cut at `timeout`).
KEEP_TICKS = 600.0
PRUNE_EVERY = 60.0
# A latest tick this far past the clock was not written ahead (that is AHEAD at most): the
# server's clock went back.
CLOCK_WENT_BACK = 60.0
# What the database says of rows it refuses (a constraint, a trigger of the operator's), as
# opposed to a connection or server failing, which fails the turn.
_REFUSED = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError,
            psycopg.InternalError)


class Scheduler(Service):
    name = "scheduler"
    leader_only = True
    interval = INTERVAL
    timeout = 30.0

    def __init__(self, db: Database, schedules: Sequence[Schedule], *, grace: float,
                 ahead: float = AHEAD) -> None:
        self._db = db
        # Its own connection: handlers holding every pooled one must not make ticks late.
        self._conn = self.use_own_connection(db, "scheduler")
        self.schedules = list(schedules)
        # What each schedule's jobs carry, decoded once: the turn sends it back as JSON.
        self._specs = {s.name: [s.name, s.task, json.loads(s.payload), s.queue, s.priority,
                                s.max_attempts] for s in self.schedules}
        self.grace = timedelta(seconds=grace)
        self.ahead = timedelta(seconds=ahead)
        # name -> (latest row, first tick after it): a cache of computation, keyed by what the
        # database said, so it never decides anything on its own.
        self._next: dict[str, tuple[datetime, datetime | None]] = {}
        self._pruned_at = 0.0
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop, in turn()
        # Schedules that failed, with what was logged: logged again only when it changes.
        self._failing: dict[str, str] = {}
        self.enqueued = 0
        self.last_turn: dict[str, float] = {}

    async def turn(self, now: datetime | None = None) -> int:
        """One pass over every schedule; returns the number of jobs enqueued. `now` replaces
        the server's clock (tests)."""
        st = self._db.sql
        started = time.perf_counter()
        names = [s.name for s in self.schedules]
        async with self._conn.connection() as conn:
            cur = await conn.execute(st.periodic_last_ticks, {"names": names})
            rows = await cur.fetchall()
        read = time.perf_counter()
        latest: dict[str, datetime | None] = {r[0]: r[1] for r in rows}
        server_now: datetime = rows[0][2] if rows else datetime.now().astimezone()
        if now is None:
            now = server_now
        # In a thread: the event loop's claims and heartbeats never wait for tick arithmetic,
        # however many schedules there are (periodic.py also bounds every walk). A limiter of
        # its own: handlers holding every token of anyio's default one must not starve it.
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        ticks, went_back = await anyio.to_thread.run_sync(self._compute, latest, now,
                                                          limiter=self._limiter)
        computed = time.perf_counter()
        if went_back:
            await self._restart_from(went_back, latest, now)
        n = await self._write_all(ticks) if ticks else 0
        self.enqueued += n
        if time.monotonic() - self._pruned_at > PRUNE_EVERY:
            self._pruned_at = time.monotonic()
            async with self._conn.connection() as conn:
                await conn.execute(st.periodic_ticks_prune, {"keep": KEEP_TICKS})
        done = time.perf_counter()
        self.last_turn = {"read": read - started, "compute": computed - read,
                          "write": done - computed, "total": done - started}
        return n

    async def _write_all(self, ticks: dict[str, list[list[object]]]) -> int:
        """Write every schedule's due ticks in one statement; a schedule the database refuses
        is written alone from then on, so that only it is left out."""
        together = [name for name in ticks if name not in self._failing]
        alone = [name for name in ticks if name in self._failing]
        n = 0
        if together:
            try:
                n += await self._write(together, ticks)
            except _REFUSED as e:
                if len(together) == 1 and not alone:
                    self._failed(together[0], "writing its jobs", e)
                    return 0
                log.debug("writing the ticks of %d schedules at once failed (%s); writing "
                          "each alone", len(together), e)
                alone = list(ticks)
        refused: list[Exception] = []
        for name in alone:
            try:
                n += await self._write([name], ticks)
            except _REFUSED as e:
                self._failed(name, "writing its jobs", e)
                refused.append(e)
                continue
            if self._failing.pop(name, None) is not None:
                log.warning("schedule %s: its ticks are enqueued again", name)
        if len(refused) > 1 and len(refused) == len(ticks):
            raise refused[0]  # not one schedule: the turn fails and backs off
        return n

    async def _write(self, names: list[str], ticks: dict[str, list[list[object]]]) -> int:
        rows = [row for name in names for row in ticks[name]]
        async with self._conn.connection() as conn:
            cur = await conn.execute(self._db.sql.periodic_ticks_enqueue, {
                "schedules": json.dumps([self._specs[name] for name in names],
                                        separators=(",", ":")),
                "ticks": json.dumps(rows, separators=(",", ":")),
                "channel": self._db.channel})
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def _restart_from(self, names: list[str], latest: dict[str, datetime | None],
                            now: datetime) -> None:
        """Delete the ticks past the clock (and past what a turn writes ahead) of schedules
        whose latest tick is far in the future: the server's clock was set back."""
        async with self._conn.connection() as conn:
            await conn.execute(self._db.sql.periodic_ticks_forget_future,
                               {"names": names, "after": now + self.ahead})
        for name in names:
            self._next.pop(name, None)
            last = latest[name]
            assert last is not None
            log.warning("schedule %s: its latest tick (%s) is %.0f s past the database "
                        "server's clock (%s): the clock was set back. Its ticks past the clock "
                        "are forgotten and it goes on from now", name, last.isoformat(),
                        (last - now).total_seconds(), now.isoformat())

    def _compute(self, latest: dict[str, datetime | None],
                 now: datetime) -> tuple[dict[str, list[list[object]]], list[str]]:
        """Each schedule's due ticks, and the schedules whose latest tick is past the clock."""
        ticks: dict[str, list[list[object]]] = {}
        went_back: list[str] = []
        for s in self.schedules:
            last = latest.get(s.name)
            if last is not None and last > now + timedelta(seconds=CLOCK_WENT_BACK):
                went_back.append(s.name)
                continue
            try:
                due = self._due(s, last, now)
            except Exception as e:  # a bug in one schedule must not stop the others
                self._failed(s.name, "computing its ticks", e, traceback=True)
                continue
            if due:
                ticks[s.name] = due
        return ticks, went_back

    def _failed(self, name: str, doing: str, e: Exception, *, traceback: bool = False) -> None:
        kind = type(e).__name__
        if self._failing.get(name) == kind:
            return  # logged already: once per kind of failure, not once a second
        self._failing[name] = kind
        log.error("schedule %s: %s failed (%s: %s); it is skipped until that succeeds, the "
                  "other schedules go on", name, doing, kind, e, exc_info=traceback)

    def _due(self, s: Schedule, last: datetime | None, now: datetime) -> list[list[object]]:
        """[name, tick, enqueue] rows for this turn."""
        rows: list[list[object]] = []
        if last is None:
            rows.append([s.name, now.isoformat(), False])
            last = now
        cached = self._next.get(s.name)
        if cached is not None and cached[0] == last:
            nxt = cached[1]
        else:
            nxt = s.next_after(last)
            self._next[s.name] = (last, nxt)
        horizon = now + self.ahead
        if nxt is None or nxt > horizon:
            return rows
        missed: list[datetime] = []
        if nxt <= now:
            if nxt >= now - self.grace:
                # All of them: ticks are at least a second apart, so a gap shorter than grace
                # holds at most this many.
                missed, _ = s.clock.latest(last, now, int(self.grace.total_seconds()) + 2)
            elif s.catch_up:
                missed, more = s.clock.latest(last, now, MAX_CATCH_UP)
                if more:
                    log.warning("schedule %s: more than %d ticks were missed since %s; "
                                "enqueuing the latest %d", s.name, MAX_CATCH_UP,
                                last.isoformat(), MAX_CATCH_UP)
            else:
                missed, _ = s.clock.latest(last, now, 1)
                log.info("schedule %s: ticks were missed since %s while no scheduler ran; "
                         "enqueuing the latest (%s) only (catch_up=True enqueues all)",
                         s.name, last.isoformat(), missed[0].isoformat() if missed else "-")
        upcoming: list[datetime] = []
        for tick in s.clock.forward(max(last, now)):
            if tick > horizon:
                break
            upcoming.append(tick)
        rows.extend([s.name, t.isoformat(), True] for t in (*missed, *upcoming))
        return rows
