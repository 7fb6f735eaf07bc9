"""Queue.wait: one listening connection per Queue, shared by every wait in the process.

A wait registers its job id; the waiter's loop marks the jobs it has not marked yet (`waited`,
0011_results.sql) and reads them, in one statement each for the whole batch, once its LISTEN on
<schema>_done is in place. From then on, the statement that makes a marked job final names it on
that channel, and the loop reads the jobs named. Nothing else is read while nothing is named:
waits cost the database nothing while they wait.

Notifications are not guaranteed: the listening connection can drop (those sent meanwhile are
lost), and a job finished by a statement that does not notify (by hand, by an older release)
sends none. So every `RECHECK` seconds, and at every reconnection, the loop reads every job still
waited for: a lost notification delays a wait by at most that much, never forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import psycopg
import psycopg.errors
from psycopg import AsyncConnection, sql

from ._db.database import Database
from ._db.retrying import RETRYABLE, RetryPolicy
from .errors import AsyncJobQError, JobNotFoundError, QueueClosedError, reason
from .job import JobInfo

log = logging.getLogger("asyncjobq.wait")

RETRY_ON: tuple[type[Exception], ...] = (*RETRYABLE, OSError)
# Seconds between reads of every job still waited for: the most a lost notification delays
# a wait.
RECHECK = 5.0
# Seconds between reads of every waited job when there is no LISTEN (a transaction pooler
# without listen_dsn): a wait ends at most this long after its job does.
POLL = 0.5
# Jobs read per statement: an id list this long is one index scan per table.
BATCH = 5000
# Seconds the listening connection is kept once no wait is left.
IDLE = 60.0
# A quiet listening connection is probed this often, so that a dead one is noticed.
KEEPALIVE = 10.0


class Waiter:
    def __init__(self, db: Database) -> None:
        self._db = db
        # As the worker names its own connections (-listen, -heartbeat): found in
        # pg_stat_activity by the queue's application_name.
        self._name = f"{db.application_name}-wait"
        self._futures: dict[int, list[asyncio.Future[JobInfo]]] = {}
        self._unmarked: set[int] = set()  # registered, not yet marked and read
        self._named: set[int] = set()  # named on <schema>_done, to read
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.loop = asyncio.get_running_loop()
        self.connects = 0  # LISTEN connections made (none behind a pooler without listen_dsn)
        self.reads = 0  # statements reading waited jobs (tests count them)

    async def wait(self, job_id: int) -> JobInfo:
        fut: asyncio.Future[JobInfo] = self.loop.create_future()
        self._futures.setdefault(job_id, []).append(fut)
        self._unmarked.add(job_id)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="asyncjobq waits")
        try:
            return await fut
        finally:
            waiting = self._futures.get(job_id)
            if waiting is not None:
                with contextlib.suppress(ValueError):
                    waiting.remove(fut)
                if not waiting:
                    del self._futures[job_id]
                    self._unmarked.discard(job_id)

    async def close(self) -> None:
        """The queue is closing: its waits end with QueueClosedError, its connection closes."""
        self._fail_all(QueueClosedError(
            "Queue.wait: the queue was closed while waiting; wait on an open queue"))
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError  # the caller's own cancel, not the loop's

    # --- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        retry = RetryPolicy(log, "waiting for jobs" + (
            " (LISTEN connection)" if self._db.listen_dsn else " (reading them)"))
        while self._futures:
            try:
                with self._db.translate_errors():
                    await self._listen(retry)
            except AsyncJobQError as e:  # the schema is missing or older: say so, not retry
                self._fail_all(e)
            except psycopg.errors.InsufficientPrivilege as e:
                self._fail_all(AsyncJobQError(
                    f"Queue.wait: {reason(e)}: the role that waits needs SELECT on jobs and "
                    "jobs_history and UPDATE (waited) on jobs (docs/guides/roles.md)"))
            except RETRY_ON as e:
                await asyncio.sleep(retry.failed(e))
            except Exception as e:  # a bug of ours: the waits end with it rather than hang
                log.exception("waiting for jobs failed")
                self._fail_all(AsyncJobQError(f"Queue.wait failed: {reason(e)}"))

    def _fail_all(self, error: AsyncJobQError) -> None:
        # Settled and forgotten at once: each wait's own `finally` finds nothing to remove.
        for futs in self._futures.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(error)
        self._futures.clear()
        self._unmarked.clear()

    async def _listen(self, retry: RetryPolicy) -> None:
        dsn = self._db.listen_dsn
        if dsn is None:
            # Behind a transaction pooler LISTEN hears nothing: every waited job is read
            # every POLL seconds instead (Queue(listen_dsn=...) avoids it).
            await self._serve(retry, None, POLL)
            return
        conn = await AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=max(1, round(self._db.connect_timeout)),
            application_name=self._name)
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(
                sql.Identifier(self._db.done_channel)))
            await self._serve(retry, conn, RECHECK)
        finally:
            await conn.close()

    async def _serve(self, retry: RetryPolicy, conn: AsyncConnection[tuple[object, ...]] | None,
                     recheck: float) -> None:
        if conn is not None:
            self.connects += 1
        # Notifications sent before this LISTEN are lost: read every waited job again.
        await self._read(set(self._futures), mark=set(self._unmarked))
        retry.succeeded()  # only once a read went through: a failing read backs off
        last_full = time.monotonic()
        idle_since: float | None = None
        notifies = asyncio.create_task(self._hear(conn) if conn is not None
                                       else asyncio.Event().wait())
        try:
            # Kept while waits come and go, and IDLE seconds after the last: an app that
            # waits for one job at a time does not connect for each.
            while self._futures or (idle_since is not None
                                    and time.monotonic() - idle_since < IDLE):
                if not self._futures and idle_since is None:
                    idle_since = time.monotonic()
                elif self._futures:
                    idle_since = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(recheck):
                        await self._wake.wait()
                if notifies.done():
                    notifies.result()  # the connection's error, raised here
                    return
                self._wake.clear()
                if time.monotonic() - last_full >= recheck:
                    # Every `recheck` seconds, woken or not: lost notifications (and jobs
                    # finished by statements that send none) are found here.
                    last_full = time.monotonic()
                    await self._read(set(self._futures), mark=set(self._unmarked))
                else:
                    named, self._named = self._named & set(self._futures), set()
                    await self._read(named | self._unmarked, mark=set(self._unmarked))
        finally:
            notifies.cancel()
            with contextlib.suppress(asyncio.CancelledError, *RETRYABLE):
                await notifies

    async def _hear(self, conn: AsyncConnection[tuple[object, ...]]) -> None:
        try:
            while True:
                async for n in conn.notifies(timeout=KEEPALIVE):
                    try:
                        job_id = int(n.payload)
                    except ValueError:
                        continue
                    if job_id in self._futures:
                        self._named.add(job_id)
                        self._wake.set()
                await conn.execute("SELECT 1")
        finally:
            self._wake.set()  # the loop sees this task ended, and reconnects

    async def _read(self, ids: set[int], *, mark: set[int]) -> None:
        """Mark `mark` as waited for, then read `ids`: settle the futures of final jobs and of
        ids that do not exist."""
        self._unmarked -= mark
        todo = sorted(ids | mark)
        try:
            for start in range(0, len(todo), BATCH):
                part = todo[start:start + BATCH]
                marking = [i for i in part if i in mark]
                async with self._db.connection() as conn:
                    if marking:
                        await conn.execute(self._db.sql.job_mark_waited, {"ids": marking})
                    cur = await conn.execute(self._db.sql.job_get_many, {"ids": part})
                    rows = await cur.fetchall()
                self.reads += 1
                self._settle(part, [JobInfo(*r) for r in rows])
        except BaseException:
            self._unmarked |= mark & set(self._futures)  # marked again on the next turn
            raise

    def _settle(self, ids: list[int], infos: list[JobInfo]) -> None:
        found = {i.id: i for i in infos}
        for job_id in ids:
            info = found.get(job_id)
            if info is not None and not info.is_final:
                continue
            for fut in self._futures.get(job_id, ()):
                if fut.done():
                    continue
                if info is None:
                    fut.set_exception(JobNotFoundError(job_id))
                else:
                    fut.set_result(info)

