"""A connection of its own for one busy loop (the fetcher's, the completer's), or for a
maintenance service that must not wait behind handlers for the pool (the elector's, the
reaper's, the scheduler's: handlers holding every pooled connection would otherwise cost a
healthy leader its lease, stall reaping and skip periodic ticks; services.py).

Taking a connection from the pool for every claim or flush costs the pool's bookkeeping (and,
with a check on checkout, a round trip: see database.check_idle_connection; the figures are in
benchmarks/results/PROFILE.md). A loop
that runs statement after statement holds one connection instead, opened like the pool's
(autocommit, application_name) but outside it, so handlers keep the whole pool. A connection
that failed is closed; the next use opens another (the loops already back off on errors).

Its prepared statements keep one generic plan instead of being planned again on every
execution: PostgreSQL's own choice stays with custom plans for the completion-and-claim
statement, whose planning then costs as much as running it (0.3 ms each, EXPLAIN ANALYZE at
batch 10). The statements are written so that a plan blind to their parameters is still the
right one (see sql.Statements._job_claim_update).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection, AsyncCursor

from .._db.database import Database
from . import jsonload


class OwnConnection:
    """`async with own:` around the loop; inside it, `own.use()` gives the connection."""

    def __init__(self, db: Database, role: str, *, generic_plans: bool = True) -> None:
        self._db = db
        self._role = role
        self._generic_plans = generic_plans
        self._conn: AsyncConnection[Any] | None = None
        # One cursor for every statement on it: a new one per execute costs its set-up and
        # its loaders' (about 20 us of the worker's CPU a statement, benchmarks/results/PINNED.md).
        self._cursor: AsyncCursor[Any] | None = None
        self.active = False
        # One user at a time: a service's turn and a direct call of it (Reaper.reap) would
        # otherwise share the connection, nest their transactions, or close it under the other.
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> OwnConnection:
        self.active = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.active = False
        await self.close()

    @property
    def plans_as_worker(self) -> bool:
        """Whether connection() now gives its own connection, planning with the worker's
        settings (sql/claim.py _worker_plan_settings): not a pooled one, and not behind a
        transaction pooler, where no session setting stays."""
        return self.active and self._generic_plans and not self._db.pooled

    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[Any]]:
        """Its own connection while the loop runs, else (direct calls, tests) a pooled one."""
        return self.use() if self.active else self._db.connection()

    @asynccontextmanager
    async def use(self) -> AsyncIterator[AsyncConnection[Any]]:
        async with self._lock:
            if self._conn is not None and (self._conn.closed or self._conn.broken):
                await self._close()
            if self._conn is None:
                self._conn = await self._connect()
            try:
                yield self._conn
            except (psycopg.Error, anyio.get_cancelled_exc_class()):
                # Whatever state it is in (a statement cut off by a cancel may still be running
                # on it), do not reuse it.
                await self._close()
                raise

    def cursor(self, conn: AsyncConnection[Any]) -> AsyncCursor[Any]:
        """A cursor of `conn`: the one kept for its own connection, a new one for another
        (a pooled connection, outside the loop)."""
        if conn is not self._conn:
            return conn.cursor()
        if self._cursor is None:
            self._cursor = conn.cursor()
        return self._cursor

    async def _connect(self) -> AsyncConnection[Any]:
        q = self._db
        conn = await AsyncConnection.connect(
            q.dsn, autocommit=True, connect_timeout=max(1, int(q.connect_timeout)),
            application_name=f"{q.application_name}-{self._role}", **q.connect_options())
        jsonload.install(conn)
        if not self._generic_plans or q.pooled:
            # Behind a transaction pooler a session setting would stay on whichever server
            # connection ran it (another client's next): plans are made for each execution.
            return conn
        # Prepared from the first execution, not psycopg's fifth: every claim and flush of the
        # loop runs on the generic plan (direct calls outside the loop use the pool).
        conn.prepare_threshold = 0
        try:
            await conn.execute(q.sql.session_worker_plans)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await conn.close()
            raise
        return conn

    async def close(self) -> None:
        """Close it once no caller is using it (the next use opens another)."""
        async with self._lock:
            await self._close()

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        self._cursor = None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                await conn.close()
