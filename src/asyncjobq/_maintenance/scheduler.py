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
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

import anyio.lowlevel

from .._db.database import Database
from .periodic import Schedule
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
# Compute this many schedules between two yields to the event loop: claims and heartbeats
# must not wait for a turn over thousands of schedules.
YIELD_EVERY = 50


class Scheduler(Service):
    name = "scheduler"
    leader_only = True
    interval = INTERVAL
    timeout = 30.0

    def __init__(self, db: Database, schedules: Sequence[Schedule], *, grace: float,
                 ahead: float = AHEAD) -> None:
        self._db = db
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
        self.enqueued = 0
        self.last_turn: dict[str, float] = {}

    async def turn(self, now: datetime | None = None) -> int:
        """One pass over every schedule; returns the number of jobs enqueued. `now` replaces
        the server's clock (tests)."""
        st = self._db.sql
        started = time.perf_counter()
        names = [s.name for s in self.schedules]
        async with self._db.connection() as conn:
            cur = await conn.execute(st.periodic_last_ticks, {"names": names})
            rows = await cur.fetchall()
        read = time.perf_counter()
        latest: dict[str, datetime | None] = {r[0]: r[1] for r in rows}
        server_now: datetime = rows[0][2] if rows else datetime.now().astimezone()
        if now is None:
            now = server_now
        ticks: list[list[object]] = []
        specs: list[list[object]] = []
        for i, s in enumerate(self.schedules):
            if i and i % YIELD_EVERY == 0:
                await anyio.lowlevel.checkpoint()
            due = self._due(s, latest.get(s.name), now)
            if due:
                ticks.extend(due)
                specs.append(self._specs[s.name])
        computed = time.perf_counter()
        n = 0
        if ticks:
            async with self._db.connection() as conn:
                cur = await conn.execute(st.periodic_ticks_enqueue, {
                    "schedules": json.dumps(specs, separators=(",", ":")),
                    "ticks": json.dumps(ticks, separators=(",", ":")),
                    "channel": self._db.channel})
                row = await cur.fetchone()
            n = int(row[0]) if row else 0
            self.enqueued += n
        if time.monotonic() - self._pruned_at > PRUNE_EVERY:
            self._pruned_at = time.monotonic()
            async with self._db.connection() as conn:
                await conn.execute(st.periodic_ticks_prune, {"keep": KEEP_TICKS})
        done = time.perf_counter()
        self.last_turn = {"read": read - started, "compute": computed - read,
                          "write": done - computed, "total": done - started}
        return n

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
            if nxt >= now - self.grace or s.catch_up:
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
