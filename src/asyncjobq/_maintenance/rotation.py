"""Empties the other generation of jobs by TRUNCATE while a pinned xmin horizon keeps vacuum
from removing anything (docs/how-it-works/storage.md).

`jobs` is partitioned in two generations (0013_generations.sql): inserts go to the current
one, claims name it. Every turn the leader:

- sweeps into the current partition the queued rows the other one still holds (an insert that
  began before the last switch, a retry or snooze of a job claimed before it, a workflow's
  child released there): claims do not read that partition;
- while a session has held the horizon for HELD seconds (`ROTATION_ENV=always`: whatever the
  horizon), and the current partition has grown past ROTATE_AT and past twice what it held
  just after the last switch (so that the rows each switch copies, the live ones, cost no more
  than the dead space it gives back), switches: the other partition's live rows are moved
  into the current one in short transactions (`drain_old_jobs()`), then `rotate_jobs()` locks
  it without waiting (NOWAIT), moves what is left, TRUNCATEs it, makes it current and moves
  the old one's best queued rows in; the sweep moves the rest.

Without a held horizon vacuum keeps the partition small and nothing switches.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .._db.database import Conn, Database
from .._db.sql import Statement
from ..errors import ConfigurationError
from .services import Service

log = logging.getLogger("asyncjobq.rotation")

# "held" (the default): switch only while a session holds the xmin horizon; "always": on
# size alone (tests, and a table bloated by a backlog); "off": never (sweeps still run).
ROTATION_ENV = "ASYNCJOBQ_ROTATION"
# Switch once the current partition, its indexes and TOAST included, holds this many bytes
# (ASYNCJOBQ_ROTATE_MB overrides): the size a pinned horizon leaves the hot path at most is
# about twice this, whatever the pin's length.
ROTATE_AT = 16 * 1024 * 1024
ROTATE_MB_ENV = "ASYNCJOBQ_ROTATE_MB"
# A session has held the horizon this long: vacuum can remove nothing newer than it.
HELD = 2.0
# Rows moved by one statement (one transaction) of a sweep, of the drain before a switch, and
# of the switch's move of the old backlog; a turn repeats them for MOVE_BUDGET seconds at most.
BATCH = 5000
MOVE_BUDGET = 5.0


class Rotation(Service):
    """A leader-only maintenance service (services.py)."""

    name = "rotation"
    leader_only = True
    timeout = 60.0
    # The sweep must not wait long behind a failed turn.
    max_backoff = 5.0

    def __init__(self, db: Database, *, interval: float = 1.0) -> None:
        self._db = db
        self.interval = interval
        self.mode = os.environ.get(ROTATION_ENV) or "held"
        if self.mode not in ("held", "always", "off"):
            raise ConfigurationError(f"{ROTATION_ENV}={self.mode!r}: use held (the default), "
                                     "always or off")
        mb = os.environ.get(ROTATE_MB_ENV)
        try:
            self.rotate_at = int(float(mb) * 1024 * 1024) if mb else ROTATE_AT
        except ValueError:
            self.rotate_at = -1
        if self.rotate_at <= 0:
            raise ConfigurationError(f"{ROTATE_MB_ENV}={mb!r}: give the size in MB at which "
                                     "the current partition of jobs is switched (16 by default)")
        self.switches = 0
        self.swept = 0  # queued rows moved into the current partition by sweeps
        self.refused = 0  # switches that could not take the lock
        self._after: int | None = None  # bytes in the current partition after our last switch
        self._refusal_logged = False
        # Its own connection: a pool that handlers hold must not delay the sweep.
        self.use_own_connection(db, "rotation")

    async def turn(self) -> bool:
        """Sweep, and switch when it is time; True when it switched."""
        st = self._db.sql
        assert self.own_connection is not None
        async with self.own_connection.connection() as conn:
            cur = await conn.execute(st.generation_state)
            row = await cur.fetchone()
            if row is None:
                return False
            gen, size, stray, held_for = int(row[0]), int(row[1]), bool(row[2]), row[3]
            if stray:
                self.swept += (await self._repeat(conn, st.generation_sweep))[0]
            if self.mode == "off" or size < max(self.rotate_at, 2 * (self._after or 0)):
                return False
            if self.mode != "always" and (held_for is None or float(held_for) < HELD):
                return False
            # What the switch would move under its lock, moved first in short transactions;
            # the switch waits for a turn that finds little left (a partition holding many
            # live rows takes several turns).
            _, drained = await self._repeat(conn, st.generation_drain)
            if not drained:
                return False
            result = await self._call(conn, st.generation_rotate)
            moved = int(result[0]) if result else -1
            if moved < 0:
                self.refused += 1
                if not self._refusal_logged:
                    self._refusal_logged = True
                    log.warning(
                        "%s.jobs_%d could not be locked to be emptied: a session holds a lock "
                        "on it (idle in a transaction that read jobs?); trying again every "
                        "%g s, the current partition grows meanwhile",
                        self._db.schema, 1 - gen, self.interval)
                return False
            # The rest of the old partition's backlog, into the new current one.
            self.swept += (await self._repeat(conn, st.generation_sweep))[0]
            cur = await conn.execute(st.generation_state)
            after = await cur.fetchone()
            self._after = int(after[1]) if after else None
        self.switches += 1
        self._refusal_logged = False
        log.info("jobs generation %d is current: jobs_%d emptied by TRUNCATE (jobs_%d held "
                 "%.1f MB)", 1 - gen, 1 - gen, gen, size / 1024 / 1024)
        return True

    async def _repeat(self, conn: Conn, statement: Statement) -> tuple[int, bool]:
        """Run a move of up to BATCH rows, each in a transaction of its own, until one moves
        fewer (True: nothing left), or for MOVE_BUDGET seconds (False); the rows moved."""
        total = 0
        until = time.monotonic() + MOVE_BUDGET
        while True:
            row = await self._call(conn, statement)
            moved = int(row[0]) if row and row[0] is not None else 0
            total += moved
            if moved < BATCH:
                return total, True
            if time.monotonic() > until:
                return total, False

    async def _call(self, conn: Conn, statement: Statement) -> tuple[Any, ...] | None:
        # READ COMMITTED, in a transaction of its own: every move must see what committed
        # before it (0013's functions refuse anything else), whatever the role's or the
        # database's default isolation; one transaction, so behind a pooler too.
        async with conn.transaction():
            await conn.execute(self._db.sql.read_committed)
            cur = await conn.execute(statement, {"n": BATCH})
            return await cur.fetchone()
