"""Vacuums the hot table between autovacuum's visits.

Autovacuum looks at each database once per `autovacuum_naptime` (one minute by default, a
server-wide setting no table can lower). A busy queue turns its table over thousands of times in
that minute, and until a vacuum runs every finished job leaves a dead entry in the claim index,
which the next claims read through (the article's 461 blocks). The hot table holds only live
jobs, so vacuuming it takes milliseconds: each worker checks every `interval` seconds (a cheap
statistics read) and one of them vacuums when enough rows are dead.
A worker role that does not own the table may not vacuum it; the worker then logs so once and
leaves the table to autovacuum.
"""

from __future__ import annotations

import logging

from .._db.database import Database
from .services import Service

log = logging.getLogger("asyncjobq.vacuum")

# Vacuum when this many rows are dead, plus 5 % of the live ones (autovacuum: 500 + 1 %, but
# only once a minute). A claim reads about one index page per ~200 dead entries it passes.
MIN_DEAD = 1000
DEAD_FRACTION = 0.05


class HotTableVacuum(Service):
    """A leader-only maintenance service (services.py)."""

    name = "vacuum"
    leader_only = True

    def __init__(self, db: Database, *, interval: float) -> None:
        self._db = db
        self.interval = interval
        self.vacuums = 0
        self.disabled = False

    async def turn(self) -> bool:
        """Vacuum the jobs table if it needs it and no other worker is; True if it ran."""
        st = self._db.sql
        async with self._db.connection() as conn:
            cur = await conn.execute(st.job_table_dead_tuples)
            row = await cur.fetchone()
            if row is None:
                return False
            dead, live, since, may_vacuum = int(row[0]), int(row[1]), row[2], bool(row[3])
            if not may_vacuum:
                log.info("this role does not own %s.jobs, so it cannot vacuum it: leaving that "
                         "to autovacuum (run workers as the owner for a faster claim)",
                         self._db.schema)
                self.disabled = True
                return False
            if dead < MIN_DEAD + DEAD_FRACTION * live:
                return False
            if since is not None and float(since) < self.interval:
                return False
            cur = await conn.execute(st.hot_vacuum_try_lock)
            locked = await cur.fetchone()
            if not locked or not locked[0]:
                return False
            try:
                await conn.execute(st.job_table_vacuum)
            finally:
                await conn.execute(st.hot_vacuum_unlock)
        self.vacuums += 1
        log.debug("vacuumed %s.jobs (%d dead rows)", self._db.schema, dead)
        return True
