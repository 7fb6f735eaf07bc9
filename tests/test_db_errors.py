"""Database errors that are not a lost connection (issue 17, item 7): a server turned read-only
(failover to a promoted standby), a privilege revoked, a statement_timeout firing. The worker
logs each kind once with what to do, backs off, keeps every outcome it holds, and resumes."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from typing import Any

import anyio
import psycopg
import psycopg.errors
import pytest
from conftest import execute, fetchval, running, wait_for
from drills import Drill, assert_clean, no_tracebacks
from psycopg import sql
from psycopg.conninfo import make_conninfo

from asyncjobq import Job, Queue, Worker
from asyncjobq.cli import _guard
from asyncjobq.errors import SchemaNotInstalledError

PARTS = ("asyncjobq.fetcher", "asyncjobq.completer")


def warnings_from(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == logger and r.levelno == logging.WARNING
               and text in r.getMessage())


def warnings_until_success(caplog: pytest.LogCaptureFixture, logger: str, text: str) -> int:
    """warnings_from, counted up to the logger's first "works again" (RetryPolicy)."""
    found = 0
    for r in caplog.records:
        if r.name != logger:
            continue
        if r.getMessage().endswith("works again"):
            break
        found += r.levelno == logging.WARNING and text in r.getMessage()
    return found


async def history_done(q: Queue, n: int) -> bool:
    """All n jobs left the hot table, each with one `done` row in history (its primary key is
    the job's id: one row per job at most)."""
    left = await fetchval(q, "SELECT count(*) FROM {s}.jobs")
    done = await fetchval(q, "SELECT count(*) FROM {s}.jobs_history WHERE status = 'done'")
    return bool(left == 0 and done == n)


def counting_task(q: Queue, seconds: float) -> Counter[int]:
    executions: Counter[int] = Counter()

    @q.task(name="work", max_attempts=100)
    async def work(job: Job) -> None:
        executions[job.id] += 1
        await anyio.sleep(seconds)

    return executions


@pytest.mark.timeout(120)
async def test_statement_timeout_on_a_locked_table(queue: Queue, pg_dsn: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A statement_timeout for the worker's connections (as `ALTER ROLE ... SET` gives one)
    while a migration holds the jobs table: claims and flushes end in QueryCanceled."""
    caplog.set_level(logging.DEBUG, logger="asyncjobq")
    dsn = make_conninfo(pg_dsn, options="-c statement_timeout=200")
    async with Queue(dsn, schema=queue.schema) as wq:
        executions = counting_task(wq, 0.05)
        n = 300
        await queue.enqueue_many("work", [{}] * n)
        worker = Worker(wq, concurrency=10, poll_interval=0.2, lease=30)
        async with running(worker) as w:
            await wait_for(lambda: len(executions) >= 30, what="work under way")
            async with await psycopg.AsyncConnection.connect(pg_dsn) as lock:
                await lock.execute(sql.SQL("LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE")
                                   .format(sql.Identifier(queue.schema)))
                await wait_for(lambda: all(
                    warnings_from(caplog, p, "statement timeout") for p in PARTS),
                    timeout=15, what="claims and flushes cancelled by statement_timeout")
                # Long enough for several failed retries of each loop.
                await wait_for(lambda: failures(caplog, "statement timeout") >= 6, timeout=15,
                               what="retries")
                await lock.rollback()
            await wait_for(lambda: history_done(queue, n), timeout=60, what="every job done")
            assert w.completed == n
        for part in PARTS:
            # Once per kind until a success, with what to do: not once per retry. (After the
            # lock's release a lane's statement that waited for it may still time out, beside
            # the other lane's success: logged again, rightly, so the count stops there.)
            assert warnings_until_success(caplog, part, "statement_timeout") == 1, part
    assert len(executions) == n


def failures(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """Failed statements of the fetcher and completer, logged or not (debug after the first)."""
    return sum(1 for r in caplog.records if r.name in PARTS and text in r.getMessage())


@pytest.mark.timeout(120)
async def test_privilege_revoked_then_granted(queue: Queue, pg_dsn: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """The worker's role loses UPDATE and DELETE on the jobs table for a while (REVOKE takes
    effect on existing sessions at their next statement), then gets them back."""
    caplog.set_level(logging.DEBUG, logger="asyncjobq")
    role = f"ajq_{uuid.uuid4().hex[:12]}"
    s, r = sql.Identifier(queue.schema), sql.Identifier(role)
    async with queue.connection() as conn:
        await conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(r))
    try:
        async with queue.connection() as conn:
            await conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {s} TO {r}; "
                                       "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN "
                                       "SCHEMA {s} TO {r}; GRANT USAGE, SELECT ON ALL SEQUENCES "
                                       "IN SCHEMA {s} TO {r}").format(s=s, r=r))
        async with Queue(make_conninfo(pg_dsn, user=role), schema=queue.schema) as wq:
            executions = counting_task(wq, 0.05)
            n = 300
            await queue.enqueue_many("work", [{}] * n)
            worker = Worker(wq, concurrency=10, poll_interval=0.2, lease=30)
            async with running(worker) as w:
                await wait_for(lambda: len(executions) >= 30, what="work under way")
                await execute(queue, f"REVOKE UPDATE, DELETE ON {{s}}.jobs, {{s}}.jobs_0,"
                                     f" {{s}}.jobs_1 FROM {role}")
                await wait_for(lambda: all(
                    warnings_from(caplog, p, "permission denied") for p in PARTS),
                    timeout=15, what="claims and flushes refused")
                await wait_for(lambda: failures(caplog, "permission denied") >= 6, timeout=15,
                               what="retries")
                await execute(queue, f"GRANT UPDATE, DELETE ON {{s}}.jobs, {{s}}.jobs_0,"
                                     f" {{s}}.jobs_1 TO {role}")
                await wait_for(lambda: history_done(queue, n), timeout=60, what="every job done")
                assert w.completed == n
            for part in PARTS:
                assert warnings_from(caplog, part, "GRANT") == 1, part
        assert len(executions) == n
    finally:
        async with queue.connection() as conn:
            await conn.execute(sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(r=r))


@pytest.mark.timeout(300)
@pytest.mark.processes
async def test_drill_server_read_only_for_5_seconds(private_server: Any, schema: str) -> None:
    """Failover to a promoted standby, as the worker meets it: for 5 s every write fails with
    ReadOnlySqlTransaction, on the connections the worker already holds.

    How: ALTER SYSTEM + pg_reload_conf(). A backend applies a configuration reload after
    reading its next command and before running it (PostgresMain), and an autocommit
    statement's transaction takes default_transaction_read_only when it starts: the worker's
    held connections fail from their next statement. ALTER ROLE/DATABASE ... SET would only
    reach new sessions. ALTER SYSTEM is server-wide, so the drill runs on a server of its own
    (private_server), never the shared one.
    """
    dsn = private_server.get_uri()
    async with Queue(dsn, schema=schema) as q:
        await q.install()
        drill = Drill(q, dsn, "server read-only for 5 s", jobs=3000, seconds=0.05)
        await drill.setup()
        probe = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            for _ in range(2):
                drill.start_worker()
            await wait_for(lambda: executed_at_least(drill, 300), timeout=60,
                           what="work under way")
            await set_read_only(q, True)
            try:
                # An existing session sees it (the probe, connected before the switch).
                await wait_for(lambda: read_only(probe), timeout=10, what="read-only")
                t0 = time.monotonic()
                await asyncio.sleep(5)  # the fault's length, not a wait for a condition
                assert time.monotonic() - t0 >= 5
            finally:
                await set_read_only(q, False)
            drill.fault_ended = time.monotonic()
            assert not await drill.finished(), "the drill ended before the fault did"
            result = await drill.drain()
            assert_clean(result)
            done = await fetchval(q, "SELECT count(*) FROM {s}.jobs_history "
                                     "WHERE status = 'done'")
            assert done == drill.jobs
            assert [p.poll() for p in drill.procs] == [None, None], "a worker exited"
            # They keep working: a new job is run.
            ids = await drill.enqueue_extra(1, {"seconds": 0})
            await wait_for(lambda: history_done_ids(q, ids), timeout=10, what="a new job done")
        finally:
            await probe.close()
            outputs = drill.stop()
        no_tracebacks(outputs)
        for _, err in outputs:
            # The worker's own parts, not the handlers' failures (their INSERTs failed too).
            said = [line for line in err.splitlines() if "read-only" in line
                    and " WARNING asyncjobq." in line and "asyncjobq.executor" not in line]
            assert any("accepts writes" in line for line in said), err[-3000:]
            # Logged once per kind and part, not once per retry (fetcher, completer, leader,
            # reaper, heartbeat...): a handful, where 5 s of retries would be dozens.
            assert len(said) <= 12, said


async def executed_at_least(drill: Drill, n: int) -> bool:
    return await drill.executed() >= n


async def read_only(conn: psycopg.AsyncConnection[Any]) -> bool:
    cur = await conn.execute("SHOW default_transaction_read_only")
    row = await cur.fetchone()
    return row is not None and row[0] == "on"


async def set_read_only(q: Queue, on: bool) -> None:
    # A connection of its own: the switch back must not wait for a pooled one.
    async with await psycopg.AsyncConnection.connect(q.dsn, autocommit=True) as conn:
        if on:
            await conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            await conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        await conn.execute("SELECT pg_reload_conf()")


async def history_done_ids(q: Queue, ids: list[int]) -> bool:
    n = await fetchval(q, "SELECT count(*) FROM {s}.jobs_history WHERE status = 'done' "
                          "AND id = ANY(%s)", ids)
    return bool(n == len(ids))


# --- the CLI's guard -----------------------------------------------------------------------

def test_guard_unwraps_exception_groups(capsys: pytest.CaptureFixture[str]) -> None:
    """anyio's task groups raise ExceptionGroups: a user sees our one line, not a traceback."""
    for error, line in [
        (ExceptionGroup("unhandled errors in a TaskGroup", [
            psycopg.errors.ReadOnlySqlTransaction(
                "cannot execute UPDATE in a read-only transaction")]),
         "asyncjobq: error: database error: cannot execute UPDATE in a read-only transaction"),
        (BaseExceptionGroup("outer", [ExceptionGroup("inner", [
            SchemaNotInstalledError("schema x is not installed: run install")])]),
         "asyncjobq: error: schema x is not installed: run install"),
    ]:
        @_guard
        def command(e: BaseException = error) -> None:
            raise e

        with pytest.raises(SystemExit) as exit_:
            command()
        assert exit_.value.code == 1
        assert capsys.readouterr().err.strip().splitlines() == [line]


def test_guard_keeps_the_traceback_of_a_bug() -> None:
    @_guard
    def command() -> None:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [
            psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
            ZeroDivisionError("a bug")])

    with pytest.raises(ExceptionGroup) as raised:
        command()
    assert raised.group_contains(ZeroDivisionError)
