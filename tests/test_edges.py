"""Correctness at the edges (issue 17, items 4, 5, 8a, 8b): retry_failed with shared dedup keys,
enqueue refusing a sync connection, doctor's index fixes, the hot-table vacuum's lock on stop."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import anyio
import psycopg
import pytest
from conftest import execute, fetchval, run_cli, wait_for
from psycopg.conninfo import make_conninfo

from asyncjobq import ConfigurationError, Job, Queue
from asyncjobq._db import migrations
from asyncjobq._maintenance import vacuum as vacuum_module
from asyncjobq._maintenance.services import ServiceRunner
from asyncjobq._maintenance.vacuum import HotTableVacuum
from asyncjobq.doctor import PROBLEM, Report, diagnose

# --- 4. retry_failed and dedup keys ------------------------------------------------------------


async def fail(queue: Queue, job_id: int, error: str = "boom") -> None:
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = max_attempts,"
                         " last_error = %s, finished_at = now() WHERE id = %s", error, job_id)


async def failed_runs_of_a_periodic_job(queue: Queue, key: str, runs: int) -> list[int]:
    """What a periodic job with a dedup_key that keeps failing leaves: one failed row per run."""
    ids = []
    for _ in range(runs):
        job_id = await queue.enqueue("nightly", {}, dedup_key=key)
        await fail(queue, job_id)
        ids.append(job_id)
    return ids


async def status_of(queue: Queue, *ids: int) -> list[str]:
    return [info.status if (info := await queue.get(i)) else "gone" for i in ids]


async def test_retry_failed_requeues_the_newest_failed_job_of_each_dedup_key(
        queue: Queue) -> None:
    nightly = await failed_runs_of_a_periodic_job(queue, "nightly", 3)
    hourly = await failed_runs_of_a_periodic_job(queue, "hourly", 2)
    plain = await queue.enqueue("t", {})
    await fail(queue, plain)

    retried = await queue.retry_failed()

    assert retried == 3 and retried.requeued == 3 and retried.skipped == 3
    assert await status_of(queue, *nightly) == ["failed", "failed", "queued"]
    assert await status_of(queue, *hourly) == ["failed", "queued"]
    assert await status_of(queue, plain) == ["queued"]
    # The older runs stay dead-lettered, as they were; once the requeued one is done, they can
    # be retried in turn (again the newest first).
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'failed'"
                                 " AND attempts = max_attempts") == 3


async def test_retry_failed_leaves_a_failed_job_whose_dedup_key_is_live(queue: Queue) -> None:
    [old] = await failed_runs_of_a_periodic_job(queue, "nightly", 1)
    live = await queue.enqueue("nightly", {}, dedup_key="nightly")

    retried = await queue.retry_failed()

    assert (retried, retried.requeued, retried.skipped) == (0, 0, 1)
    assert await status_of(queue, old, live) == ["failed", "queued"]


@pytest.mark.processes
async def test_cli_retry_failed_says_which_jobs_it_left_failed(queue: Queue,
                                                                pg_dsn: str) -> None:
    await failed_runs_of_a_periodic_job(queue, "nightly", 3)

    r = run_cli("retry-failed", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("requeued 1 failed job(s); left 2 failed"), r.stdout
    assert "dedup_key" in r.stdout

    r = run_cli("retry-failed", "--json", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    # The requeued one is live now: the other two keep waiting behind it.
    assert json.loads(r.stdout) == {"requeued": 0, "skipped": 2}


# --- 5. enqueue(conn=) takes an AsyncConnection only -------------------------------------------


async def test_enqueue_refuses_a_sync_connection_before_writing(queue: Queue,
                                                                pg_dsn: str) -> None:
    @queue.task(name="t")
    async def handler(job: Job) -> None: ...

    with psycopg.connect(pg_dsn) as sync_conn:
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: queue.enqueue("t", {}, conn=sync_conn),  # type: ignore[arg-type]
            lambda: queue.enqueue("t", {}, dedup_key="k", conn=sync_conn),  # type: ignore[arg-type]
            lambda: queue.enqueue_many("t", [{}], conn=sync_conn),  # type: ignore[arg-type]
            lambda: handler.enqueue({}, conn=sync_conn),  # type: ignore[arg-type]
            lambda: queue.enqueue("t", {}, conn=queue.pool),  # type: ignore[arg-type]
        ]
        errors = []
        with sync_conn.transaction():
            for call in calls:
                # Whatever is raised, the caller's transaction goes on and commits, as a
                # caller that handles the error and retries would have it.
                with pytest.raises(Exception) as caught:
                    await call()
                errors.append(caught.value)
    # Refused before any I/O: nothing was written in the committed transaction.
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 0
    for error in errors:
        assert isinstance(error, ConfigurationError), repr(error)
        assert "AsyncConnection" in str(error) and "queue.connection()" in str(error)
    assert "a sync psycopg.Connection" in str(errors[0])
    assert "pool.connection()" in str(errors[-1])


# --- 8a. doctor's fix for an index: CONCURRENTLY -------------------------------------------------


def index_fixes(report: Report) -> dict[str, str]:
    return {f.message: f.advice for f in report.findings
            if f.check == "indexes" and f.level == PROBLEM}


def advised_statements(advice: str) -> list[str]:
    """The statements of a fix, as a user copies them out of doctor's advice."""
    return [m.strip() for m in re.findall(r"(?:CREATE|DROP) [^;]*", advice)]


async def run_outside_a_transaction(pg_dsn: str, statement: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(statement.encode())


async def assert_indexes_present_and_valid(queue: Queue) -> None:
    report = await diagnose(queue)
    assert index_fixes(report) == {}
    valid = {i["index"] for i in report.indexes if i["valid"]}
    assert set(migrations.expected_indexes()) <= valid


async def test_doctor_fixes_a_missing_index_with_create_index_concurrently(
        queue: Queue, pg_dsn: str) -> None:
    expected = migrations.expected_indexes()  # plain, partial, BRIN, partitioned
    # A partition's index attached to jobs' goes with it (0013_generations.sql).
    dropped = [i for i in expected if not re.match(r"jobs_[01]_", i)]
    for index in dropped:
        await execute(queue, f"DROP INDEX {{s}}.{index}")

    fixes = index_fixes(await diagnose(queue))

    assert len(fixes) == len(dropped), fixes
    for message, advice in fixes.items():
        assert "is missing" in message
        statements = advised_statements(advice)
        # A plain CREATE INDEX locks out every claim, completion and heartbeat for the whole
        # build; past the lease, the reaper then requeues healthy running jobs. On jobs, which
        # CONCURRENTLY refuses, each partition's index is built so first, then only attached.
        if f"on {queue.schema}.jobs " in message:
            *builds, attach = statements
            assert [re.search(r' ON "[^"]+"\."(jobs_[01])"', b).group(1)  # type: ignore[union-attr]
                    for b in builds] == ["jobs_0", "jobs_1"], advice
            assert attach.startswith("CREATE INDEX \"jobs_"), advice
        else:
            builds = statements
        for statement in builds:
            assert re.match(r"CREATE (UNIQUE )?INDEX CONCURRENTLY ", statement), advice
        for statement in statements:
            await run_outside_a_transaction(pg_dsn, statement)
    await assert_indexes_present_and_valid(queue)


async def test_doctor_fixes_an_invalid_index_by_dropping_and_recreating_it_concurrently(
        queue: Queue, pg_dsn: str) -> None:
    # What an interrupted CREATE INDEX CONCURRENTLY leaves: an index the planner ignores.
    await execute(queue, "UPDATE pg_index SET indisvalid = false WHERE indexrelid ="
                         " '{s}.jobs_history_queue_browse_idx'::regclass")

    [(message, advice)] = index_fixes(await diagnose(queue)).items()

    assert "jobs_history_queue_browse_idx" in message and "invalid" in message
    statements = advised_statements(advice)
    assert [s.split(" ON ")[0].split(" IF EXISTS ")[0] for s in statements] == [
        "DROP INDEX CONCURRENTLY",
        'CREATE INDEX CONCURRENTLY "jobs_history_queue_browse_idx"'], advice
    for statement in statements:
        await run_outside_a_transaction(pg_dsn, statement)
    await assert_indexes_present_and_valid(queue)


async def test_doctor_finds_history_counts_that_drifted_and_its_recount_mends_them(
        queue: Queue, pg_dsn: str) -> None:
    """Rows written with the triggers disabled (a data-only restore does that, or loads the
    counts too): stats() is wrong, doctor says where, and its advice makes it exact."""
    for i in await queue.enqueue_many("t", [{}] * 2, queue="a"):
        assert await queue.cancel(i)
    await execute(queue, "ALTER TABLE {s}.jobs_history DISABLE TRIGGER USER")
    await execute(queue, "INSERT INTO {s}.jobs_history (id, queue, task, payload, status,"
                         " priority, run_at, attempts, max_attempts, created_at, finished_at)"
                         " SELECT -g, 'b', 't', '{{}}', 'done', 0, now(), 1, 3, now(), now()"
                         " FROM generate_series(1, 5) g")
    await execute(queue, "ALTER TABLE {s}.jobs_history ENABLE TRIGGER USER")
    assert "b" not in await queue.stats()
    report = await diagnose(queue)
    [finding] = [f for f in report.findings if f.check == "history counts"]
    assert finding.level == PROBLEM
    assert "b/done says 0 where history holds 5" in finding.message, finding.message
    recount = finding.advice[finding.advice.index("BEGIN;"):]
    await run_outside_a_transaction(pg_dsn, recount)
    assert (await queue.stats())["b"]["done"] == 5
    assert (await queue.stats())["a"]["cancelled"] == 2
    [finding] = [f for f in (await diagnose(queue)).findings if f.check == "history counts"]
    assert finding.level == "ok", finding


# --- 8b. the hot-table vacuum's session lock when a stop cancels it -----------------------------

# Holders of the vacuum's session advisory lock (a bigint key: its halves in classid, objid).
VACUUM_LOCK_HOLDERS = (
    "SELECT coalesce(array_agg(pid ORDER BY pid), '{{}}') FROM pg_locks"
    " WHERE locktype = 'advisory' AND objsubid = 1 AND granted"
    "   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    "   AND classid = ((hashtext(%s)::bigint >> 32) & 4294967295)::oid"
    "   AND objid = (hashtext(%s)::bigint & 4294967295)::oid")


@pytest.mark.parametrize("stop", ["worker stop", "task cancel"])
async def test_a_stop_mid_vacuum_leaves_the_vacuum_lock_free(queue: Queue, pg_dsn: str,
                                                             stop: str) -> None:
    key = f"asyncjobq.vacuum.{queue.schema}"
    await execute(queue, "ALTER TABLE {s}.jobs_0 SET (autovacuum_enabled = false)")
    await queue.enqueue_many("t", [{"i": i} for i in range(5000)])
    await execute(queue, "DELETE FROM {s}.jobs")
    # A VACUUM that runs for seconds: the cost-based delay sleeps at every page. (A lock held
    # on the table would not hold it up: it runs with SKIP_LOCKED and would skip the table.)
    app = f"vacuum-{queue.schema}"
    slow_dsn = make_conninfo(pg_dsn, options="-c vacuum_cost_delay=100 -c vacuum_cost_limit=1")

    async def vacuuming() -> int | None:
        return await fetchval(  # type: ignore[no-any-return]
            queue, "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                   " AND application_name = %s"
                   " AND state = 'active' AND query LIKE 'VACUUM%%'", app)

    async with Queue(slow_dsn, schema=queue.schema, pool_min_size=1, pool_max_size=1,
                     application_name=app) as slow:
        vacuum = HotTableVacuum(slow.database, interval=0.05)
        if stop == "worker stop":
            # Worker.stop cancels its services' task group: anyio cancels every await in it
            # again and again, psycopg's own cancellation of the VACUUM included.
            async with anyio.create_task_group() as services:
                services.start_soon(ServiceRunner([vacuum]).run)
                await wait_for(vacuuming, timeout=40, what="the vacuum to start")
                pid = await vacuuming()
                assert await fetchval(queue, VACUUM_LOCK_HOLDERS, key, key) == [pid]
                services.cancel_scope.cancel()
        else:
            # Cancelled once, psycopg cancels the VACUUM on the server and keeps the connection.
            await wait_for(lambda: fetchval(
                queue, "SELECT n_dead_tup >= 1000 FROM pg_stat_user_tables WHERE relid = %s"
                       "::regclass", f'"{queue.schema}".jobs_0'), what="the dead rows counted")
            turn = asyncio.create_task(vacuum.turn())
            await wait_for(vacuuming, timeout=40, what="the vacuum to start")
            pid = await vacuuming()
            turn.cancel()
            with pytest.raises(asyncio.CancelledError):
                await turn

        async def lock_free() -> bool:
            return await fetchval(queue, VACUUM_LOCK_HOLDERS, key, key) == []

        # Left held, no worker could vacuum again until that session ends.
        await wait_for(lock_free, timeout=10, what="the vacuum lock to be released")
        async with slow.connection() as conn:  # the pool's one connection
            cur = await conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                     " AND pid = pg_backend_pid()")
            assert await cur.fetchone() == (0,)
            if stop == "task cancel":
                assert conn.info.backend_pid == pid  # unlocked, and kept in the pool
        assert vacuum.vacuums == 0


async def test_the_vacuum_waits_while_the_horizon_has_not_moved(
        queue: Queue, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a pinned xmin horizon a VACUUM removes nothing and only reads the growing table:
    once one has run since the horizon last moved, the leader's vacuum skips its turns, and
    vacuums again once the transaction holding it ends."""
    # Not long enough for the leader to leave the table to autovacuum (the next test).
    monkeypatch.setattr(vacuum_module, "HELD_LONG", 3600.0)
    pin = psycopg.connect(pg_dsn)
    pin.execute("CREATE TEMP TABLE pin (x int)")
    pin.execute("INSERT INTO pin VALUES (1)")  # a writing transaction, left open
    vacuum = HotTableVacuum(queue.database, interval=0.05)

    async def dead_rows() -> bool:
        await execute(queue, "SELECT pg_stat_force_next_flush()")
        return int(await fetchval(queue, "SELECT n_dead_tup FROM pg_stat_user_tables"
                                         " WHERE relid = '{s}.jobs_0'::regclass")) > 2000

    try:
        await queue.enqueue_many("t", [{"i": i} for i in range(3000)])
        await execute(queue, "DELETE FROM {s}.jobs")
        await wait_for(dead_rows, 10, what="dead rows counted")
        assert await vacuum.turn() is True  # the first since the transaction began
        await asyncio.sleep(0.06)  # past the interval
        assert await vacuum.turn() is False
        assert vacuum.held_back == 1
    finally:
        pin.close()
    await wait_for(vacuum.turn, 10, what="a vacuum once the horizon moved on")


async def test_the_vacuum_is_left_to_autovacuum_while_a_session_holds_the_horizon_long(
        queue: Queue, pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session holding the horizon for long (readers at REPEATABLE READ taking turns move
    it now and then): the leader's vacuum would read the grown table beside the claims for
    the few rows older than it. It is deferred, the first time too, until that session
    ends."""
    monkeypatch.setattr(vacuum_module, "HELD_LONG", 0.5)
    reader = psycopg.connect(pg_dsn, autocommit=True)  # the BEGIN below is its own
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    reader.execute("SELECT 1")  # its snapshot, held while the transaction stays open
    vacuum = HotTableVacuum(queue.database, interval=0.05)
    try:
        await queue.enqueue_many("t", [{"i": i} for i in range(3000)])
        await execute(queue, "DELETE FROM {s}.jobs")
        pid = reader.info.backend_pid
        await wait_for(lambda: fetchval(
            queue, "SELECT now() - xact_start > interval '0.6 s' FROM pg_stat_activity"
                   " WHERE pid = %s", pid), 10, what="the reader's snapshot held long")

        async def deferred() -> bool:
            await execute(queue, "SELECT pg_stat_force_next_flush()")
            return await vacuum.turn() is False and vacuum.deferred >= 1

        await wait_for(deferred, 10, what="the vacuum deferred")
        assert vacuum.vacuums == 0 and vacuum.held_back == 0
    finally:
        reader.close()
    await wait_for(vacuum.turn, 10, what="a vacuum once the session ended")
    assert vacuum.vacuums == 1
