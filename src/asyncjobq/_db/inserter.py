"""Coalesces concurrent enqueue() calls made outside a transaction into one INSERT.

Each such call is a transaction of its own, so under concurrency every job pays a commit (a
WAL flush) and a pool checkout. Calls that arrive while `max_in_flight` INSERTs are already
running wait for the next one and go in together: one statement, one commit, one notification
per queue. A lone call starts its INSERT at once, so an idle producer waits no longer than
before, and every caller still returns only once its job is committed.

A statement refused because of one row's value is retried row by row, so only that caller
sees the error; any other failure (connection lost, schema missing) is every caller's, as it
would have been had each run alone.

`write` runs every enqueue's INSERT (these batches, a dedup_key enqueue, enqueue_many) and
decides what a failing connection means for it (docs/guides/enqueueing.md).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import psycopg.errors
from psycopg.pq import TransactionStatus
from psycopg_pool import PoolTimeout

from ..errors import (
    EnqueueConnectionError,
    EnqueueRefusedError,
    SchemaNotInstalledError,
    reason,
)
from .database import Conn, Database
from .retrying import DEADLOCK_TRIES
from .sql import Statement, Statements

# Errors that one row can cause for the whole statement: a value PostgreSQL refuses (22xxx
# data, 23xxx integrity), or rows too large together (54000, e.g. jsonb's 256 MB limit).
ROW_ERRORS = (psycopg.errors.DataError, psycopg.errors.IntegrityError,
              psycopg.errors.ProgramLimitExceeded)


class Inserter:
    def __init__(
        self,
        write: Callable[[list[str], bool], Awaitable[list[int]]],
        *,
        max_in_flight: int,
        max_rows: int = 500,
        max_bytes: int = 4 << 20,
    ) -> None:
        # JSON-array rows, and whether they share one lane -> their ids, in order, in one
        # statement.
        self._write = write
        self._max_in_flight = max_in_flight
        self._max_rows = max_rows
        self._max_bytes = max_bytes  # large payloads go in smaller statements
        self._pending: deque[tuple[str, Hashable, asyncio.Future[int]]] = deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self.statements = 0  # INSERTs run, for tests and benchmarks

    async def insert(self, row: str, lane: Hashable) -> int:
        """Insert one row (a JSON array, see sql.job_insert_rows) of `lane` (its queue and
        priority: a batch of one lane may name a partition, PartitionWriter); returns its
        job id."""
        if self._in_flight < self._max_in_flight and not self._pending:
            # Alone: the caller's own task runs its INSERT, without a hand-off to another.
            self._started()
            try:
                (job_id,) = await self._insert([row], True)
                return job_id
            finally:
                self._finished()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append((row, lane, fut))
        if self._in_flight < self._max_in_flight:
            self._launch()
        # Cancelled while still pending, the row is dropped; once its INSERT is running it
        # commits (or not) with the others, as a cancelled single INSERT might.
        return await fut

    async def drain(self) -> None:
        """Wait until every accepted row has been written or has failed."""
        while self._in_flight:
            await self._idle.wait()

    def _launch(self) -> None:
        batch: list[tuple[str, asyncio.Future[int]]] = []
        lanes: set[Hashable] = set()
        size = 0
        while self._pending and len(batch) < self._max_rows:
            row, lane, fut = self._pending[0]
            if batch and size + len(row) > self._max_bytes:
                break
            self._pending.popleft()
            if not fut.done():
                batch.append((row, fut))
                lanes.add(lane)
                size += len(row)
        if not batch:
            return
        self._started()
        task = asyncio.create_task(self._run(batch, len(lanes) == 1), name="asyncjobq enqueue")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[str, asyncio.Future[int]]], one_lane: bool) -> None:
        try:
            try:
                ids = await self._insert([row for row, _ in batch], one_lane)
            except EnqueueRefusedError as e:
                if len(batch) == 1 or not isinstance(e.__cause__, ROW_ERRORS):
                    raise
                await self._one_by_one(batch)
                return
            for (_, fut), job_id in zip(batch, ids, strict=True):
                if not fut.done():
                    fut.set_result(job_id)
        except Exception as e:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
        except BaseException:
            for _, fut in batch:
                fut.cancel()
            raise
        finally:
            self._finished()

    def _started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _finished(self) -> None:
        self._in_flight -= 1
        if self._pending:
            self._launch()
        if not self._in_flight:
            self._idle.set()

    async def _one_by_one(self, batch: list[tuple[str, asyncio.Future[int]]]) -> None:
        for row, fut in batch:
            try:
                (job_id,) = await self._insert([row], True)
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(job_id)

    async def _insert(self, rows: list[str], one_lane: bool) -> list[int]:
        self.statements += 1
        return await self._write(rows, one_lane)


async def write(db: Database, conn: Conn | None, statement: Statement, params: Any, *,
                what: str, resend: bool, advice: str,
                denied: str | None = None) -> list[tuple[Any, ...]]:
    """Run an enqueue's INSERT and return its rows; a lost connection raises
    EnqueueConnectionError, saying whether `what` ("the job", "the 3 jobs") may exist.

    Without `conn`, a failure before the statement is sent cannot have written anything, so
    it is waited out for up to db.connect_timeout: a dead pooled connection is replaced
    (Database.connection), and a server that is down is waited for. After the statement was
    sent, the server may have committed it before the reply was lost; it is sent again only
    if `resend` (a dedup_key INSERT: a second one returns the first one's job). `advice` says
    how to enqueue again safely when the job may exist; `denied`, what to grant when the
    server refuses the statement for privileges (42501), when not INSERT on jobs.

    A statement PostgreSQL ended as one side of a deadlock is sent again (DEADLOCK_TRIES in
    all): on the pool's autocommit connection it was its own transaction, rolled back whole.
    A workflow's commit marks the parents it names in id order (0012_workflows.sql,
    job_deps_named) while a worker's flush may hold one of them and wait for another.

    With `conn`, the caller's transaction is theirs: nothing is retried.
    """
    if conn is not None:
        return await _write_on_callers(db, conn, statement, params, what=what, advice=advice,
                                       denied=denied)
    deadline = time.monotonic() + db.connect_timeout
    lost: str | None = None  # why a connection was lost after the statement was sent
    deadlocks = 0
    while True:
        c: Conn | None = None
        try:
            with db.translate_errors():
                async with db.connection(timeout=max(0.0, deadline - time.monotonic())) as c:
                    cur = await c.execute(statement, params)
                    return await cur.fetchall()
        except PoolTimeout as e:  # an OperationalError too: before the next clause
            if lost is None:
                raise _no_connection(db, e) from None
            raise _maybe_written(what, lost, advice) from None
        except psycopg.Error as e:
            if c is None or not (c.closed or c.broken):
                # Not a connection failure.
                if (isinstance(e, psycopg.errors.DeadlockDetected)
                        and deadlocks + 1 < DEADLOCK_TRIES):
                    deadlocks += 1
                    continue
                raise _refused(what, e, caller=False, denied=denied) from e
            lost = reason(e)
            if not resend or time.monotonic() >= deadline:
                raise _maybe_written(what, lost, advice) from None


class PartitionWriter:
    """Runs a batch insert on the current generation's partition of jobs (sql/enqueue.py,
    `_gen`), so that PostgreSQL routes no row, and through `jobs` where it cannot.

    Which generation is current changes only when the leader switches (rotate_jobs): the
    writer guesses the last one that took its rows, and a statement that names the other one
    inserts nothing, so it is sent again on the other. Such a statement notifies its one lane
    itself (sql/enqueue.py, `_notified`): a batch of several lanes goes through `jobs`, whose
    trigger notifies each. Named partitions need INSERT and SELECT (id, queue, priority,
    run_at) on both, which a producer granted them on jobs alone lacks (docs/guides/roles.md):
    the first one-lane batch reads them from the catalog, and without them every batch goes
    through `jobs` as before. Only for the pool's connections: a statement refused in a
    caller's transaction (conn=) would abort it.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        self.guess = 0  # the generation that took the last batch
        self.usable: bool | None = None  # None: not read yet
        self._reading = asyncio.Lock()  # one catalog read for the first batches in flight

    async def write(self, statement: Callable[[Statements], Statement], params: Any, *,
                    what: str, advice: str, one_lane: bool) -> list[tuple[Any, ...]]:
        """Run `statement` (of the Statements of a partition, or of jobs) without a caller's
        connection; its rows, as `write` returns them (never none: a batch has rows).
        `one_lane`: the rows share their queue and priority."""
        if one_lane and self.usable is None:
            async with self._reading:
                if self.usable is None:
                    self.usable = await self._usable()  # None again if the read was cut off
        for _ in range(2) if one_lane and self.usable else ():
            part = self.guess
            try:
                rows = await write(self._db, None, statement(self._db.sql_of(part)), params,
                                   what=what, resend=False, advice=advice)
            except EnqueueRefusedError as e:
                if e.sqlstate != "42501":
                    raise
                self.usable = False  # a privilege revoked since: through jobs
                break
            except SchemaNotInstalledError:
                self.usable = False  # a partition gone: through jobs, which says what is wrong
                break
            if rows:
                return rows
            self.guess = 1 - part  # the other one is current: nothing was inserted
        return await write(self._db, None, statement(self._db.sql), params, what=what,
                           resend=False, advice=advice)

    async def _usable(self) -> bool | None:
        c: Conn | None = None
        try:
            # As long as the insert itself would wait for a connection (`write`).
            async with self._db.connection(timeout=self._db.connect_timeout) as c:
                cur = await c.execute(self._db.sql.job_partitions_insertable,
                                      (self._db.schema, self._db.schema))
                row = await cur.fetchone()
        except PoolTimeout as e:  # an OperationalError too: before the next clause
            raise _no_connection(self._db, e) from None
        except psycopg.Error:
            if c is None or c.closed or c.broken:
                return None  # the connection was lost: the next batch reads again
            return False  # the server refused the read (a privilege, a timeout): through jobs
        return bool(row and row[0])


async def _write_on_callers(db: Database, conn: Conn, statement: Statement, params: Any, *,
                            what: str, advice: str,
                            denied: str | None = None) -> list[tuple[Any, ...]]:
    # Outside a transaction block, an autocommit connection commits the INSERT by itself;
    # otherwise it is part of the caller's transaction, which dies with the connection.
    own_commit = conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE
    try:
        with db.translate_errors():
            cur = await conn.execute(statement, params)
            return await cur.fetchall()
    except psycopg.Error as e:
        if not (conn.closed or conn.broken):
            raise _refused(what, e, caller=not own_commit, denied=denied) from e
        if own_commit:
            raise _maybe_written(what, reason(e), advice, caller=True) from None
        raise EnqueueConnectionError(
            f"enqueue: the connection passed as conn= was lost ({reason(e)}): its transaction "
            "is lost (the server rolls it back), so nothing written in it is committed, "
            f"{what} included: run the transaction again on a new connection",
            may_have_been_written=False) from None


# What a producer can do about what the server says (the worker's loops have their own advice,
# retrying.py: they wait; a producer's caller decides).
_REFUSED_ADVICE = {
    "25006": "the server is read-only (a standby, or default_transaction_read_only is on): "
             "after a failover, point the DSN at the new primary",
    "42501": "grant the producer's role USAGE on the queue's schema, and INSERT and SELECT "
             "(id, dedup_key, status) on its jobs table (GRANT ... TO <role>; "
             "docs/guides/roles.md)",
    "57014": "the INSERT was cancelled: check statement_timeout for this role and database "
             "(SHOW statement_timeout) and what holds locks on the jobs table (pg_locks)",
    "55P03": "a lock was not granted in time: check lock_timeout and what holds locks on the "
             "jobs table (pg_locks)",
    "40P01": "a deadlock with another transaction, which PostgreSQL broke by ending this one: "
             "run it again",
    "40001": "a concurrent update to a row this transaction read (REPEATABLE READ or "
             "SERIALIZABLE): run it again, or enqueue from a READ COMMITTED transaction",
}


def _refused(what: str, e: psycopg.Error, *, caller: bool,
             denied: str | None = None) -> EnqueueRefusedError:
    sqlstate = e.sqlstate
    advice = ((denied if sqlstate == "42501" else None) or _REFUSED_ADVICE.get(sqlstate or "")
              or "fix what the server names and enqueue again")
    tx = (": the transaction on conn= is aborted, roll it back and run it again once fixed"
          if caller else "")
    return EnqueueRefusedError(
        f"enqueue: PostgreSQL refused the INSERT of {what} ({reason(e)}); nothing was "
        f"written{tx}; {advice}", sqlstate=sqlstate)


def _no_connection(db: Database, e: PoolTimeout) -> EnqueueConnectionError:
    return EnqueueConnectionError(
        f"enqueue: {reason(e)} (waited {db.connect_timeout:g} s, the Queue's connect_timeout); "
        "nothing was written: enqueue again once PostgreSQL accepts connections",
        may_have_been_written=False)


def _maybe_written(what: str, lost: str, advice: str,
                   caller: bool = False) -> EnqueueConnectionError:
    conn = "the connection passed as conn= (autocommit)" if caller else "the connection"
    return EnqueueConnectionError(
        f"enqueue: {conn} to PostgreSQL was lost after the INSERT of {what} was sent "
        f"({lost}): the server may have committed it, so {what} may or may not have been "
        f"written; {advice}",
        may_have_been_written=True)
