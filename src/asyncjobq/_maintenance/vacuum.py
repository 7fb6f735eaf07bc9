"""Vacuums the hot table between autovacuum's visits.

Autovacuum looks at each database once per `autovacuum_naptime` (one minute by default, a
server-wide setting no table can lower). A busy queue turns its table over thousands of times in
that minute, and until a vacuum runs every finished job leaves a dead entry in the claim index,
which the next claims read through (the article's 461 blocks). The hot table holds only live
jobs, so vacuuming it takes milliseconds: the leader checks every `interval` seconds (a cheap
statistics read) and vacuums when enough rows are dead (docs/operations/vacuum.md).
A worker role that does not own the table may not vacuum it; the leader then logs so once and
leaves the table to autovacuum.
The lock that keeps two workers from vacuuming at once (an old and a new leader across a
takeover) is a session lock (VACUUM cannot run in
a transaction): a turn cut short, by a stop or its timeout, still releases it, or ends the
session holding it, rather than leave it held and no worker vacuuming again.
"""

from __future__ import annotations

import logging

import anyio
import psycopg
from psycopg.pq import TransactionStatus

from .._db.database import Conn, Database
from ..errors import QueueClosedError, reason
from .services import Service

log = logging.getLogger("asyncjobq.vacuum")

# Vacuum when this many rows are dead, plus 5 % of the live ones (autovacuum: 500 + 1 %, but
# only once a minute). A claim reads about one index page per ~200 dead entries it passes.
MIN_DEAD = 1000
DEAD_FRACTION = 0.05
# How long a stopped turn may take to release the lock (it delays the worker's stop).
RELEASE_TIMEOUT = 5.0
# While a session has held the xmin horizon for over HELD_LONG seconds (a long report, readers
# at REPEATABLE READ taking turns), the leader leaves the table to autovacuum: each vacuum
# reads the whole table and its indexes, grown by the pin, to remove only the rows older than
# that session, and beside it the claims slowed. With 4 readers at 2,000 jobs/s the claim p99
# was 4.8x its unpinned value with the leader's vacuums, 5.2x with one a minute, 5.2x without
# their heap truncation, 1.2x without them (benchmarks/results/PINNED.md). The claims do not
# need it meanwhile: they start from floors (_worker/floors.py).
HELD_LONG = 10.0


class HotTableVacuum(Service):
    """A leader-only maintenance service (services.py)."""

    name = "vacuum"
    leader_only = True

    def __init__(self, db: Database, *, interval: float) -> None:
        self._db = db
        self.interval = interval
        self.vacuums = 0
        self.disabled = False
        self.held_back = 0  # turns skipped because the xmin horizon had not moved
        self.deferred = 0  # turns left to autovacuum: a session has held the horizon long
        self._began: object = None  # the server's clock as this leader's last vacuum began

    async def turn(self) -> bool:
        """Vacuum the jobs table if it needs it and no other worker is; True if it ran."""
        st = self._db.sql
        abandoned: int | None = None  # the pid of a session that may still hold the lock
        try:
            async with self._db.connection() as conn:
                cur = await conn.execute(st.job_table_dead_tuples, {"since": self._began})
                row = await cur.fetchone()
                if row is None:
                    return False
                dead, live, since, may_vacuum = int(row[0]), int(row[1]), row[2], bool(row[3])
                now, held, held_for = row[4], bool(row[5]), row[6]
                if not may_vacuum:
                    log.info("this role does not own %s.jobs, so it cannot vacuum it: leaving "
                             "that to autovacuum (run workers as the owner for a faster claim)",
                             self._db.schema)
                    self.disabled = True
                    return False
                if dead < MIN_DEAD + DEAD_FRACTION * live:
                    return False
                if since is not None and float(since) < self.interval:
                    return False
                if held:
                    # The horizon has not moved since this leader's last vacuum began: this one
                    # would remove nothing (docs/operations/xmin.md). Checked every turn.
                    self.held_back += 1
                    return False
                if held_for is not None and float(held_for) > HELD_LONG:
                    self.deferred += 1
                    return False
                pid = conn.info.backend_pid
                may_hold = True  # from the moment the lock is asked for: its reply may be lost
                try:
                    cur = await conn.execute(st.hot_vacuum_try_lock)
                    locked = await cur.fetchone()
                    may_hold = bool(locked and locked[0])
                    if not may_hold:
                        return False
                    self._began = now
                    await conn.execute(st.job_table_vacuum)
                finally:
                    if may_hold and not await self._unlock(conn):
                        # Closed, the pool discards it: no pooled session keeps the lock.
                        await conn.close()
                        abandoned = pid
        finally:
            if abandoned is not None:
                await self._end_session(abandoned)
        self.vacuums += 1
        log.debug("vacuumed %s.jobs (%d dead rows)", self._db.schema, dead)
        return True

    async def _unlock(self, conn: Conn) -> bool:
        """Release the lock on `conn`, even in a turn being cancelled (a stop, the turn's
        timeout); False when the connection cannot say, or took too long."""
        # Shielded: in a cancelled scope the unlock would be cancelled too, and a session
        # holding the lock would go back to the pool, keeping every worker from vacuuming.
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
            # Cancelled mid-VACUUM, psycopg asks the server to cancel it and waits for the
            # statement to end; cancelled again meanwhile, as anyio does, it closes the
            # connection instead, while the server goes on with the VACUUM.
            if conn.closed or conn.info.transaction_status != TransactionStatus.IDLE:
                return False
            try:
                await conn.execute(self._db.sql.hot_vacuum_unlock)
            except psycopg.Error:
                return False
            return True
        return False

    async def _end_session(self, pid: int) -> None:
        """End the session of a connection closed while it may hold the lock: the server keeps
        it until that session ends, which it does only once its VACUUM is over."""
        failure = f"no answer within {RELEASE_TIMEOUT:g} s"
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
            try:
                async with self._db.connection(timeout=RELEASE_TIMEOUT) as conn:
                    cur = await conn.execute(self._db.sql.hot_vacuum_end_abandoned,
                                             {"pid": pid})
                    ended = bool(await cur.fetchall())
                if ended:
                    # The server logs it as a FATAL "terminating connection due to
                    # administrator command": say here what that was.
                    log.info("stopped mid-VACUUM: ended its session (pid %d) so that it "
                             "releases the vacuum lock of %s.jobs", pid, self._db.schema)
                return
            except (psycopg.Error, QueueClosedError) as e:
                failure = reason(e)
        log.warning("a stopped vacuum of %s.jobs left its session (pid %d) running, and it may "
                    "hold the vacuum lock until its VACUUM is over (%s): if no worker vacuums "
                    "the table, end it with SELECT pg_terminate_backend(%d)",
                    self._db.schema, pid, failure, pid)
