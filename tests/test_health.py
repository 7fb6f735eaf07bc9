"""Queue health over time: retention and pruning of history, and `doctor` on healthy and sick
databases (a missing index, a pinned xmin horizon, a bloated table made to happen here)."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest
from conftest import execute, fetchval, run_cli, running, wait_for

from asyncjobq import Job, Queue, Retention, Worker
from asyncjobq._maintenance.pruner import prune_history
from asyncjobq.doctor import CLAIM_BLOCKS_PROBLEM, PROBLEM, Report, diagnose, explain_claim
from asyncjobq.errors import ConfigurationError


async def finish_jobs(queue: Queue, counts: dict[str, int]) -> dict[str, list[int]]:
    """Run `counts[q]` jobs per queue to `done` through a real worker; their ids by queue."""

    @queue.task(name="noop")
    async def noop(job: Job) -> None:
        pass

    ids = {q: [await noop.enqueue({"i": i}, queue=q) for i in range(n)]
           for q, n in counts.items()}
    async with running(Worker(queue, queues=tuple(counts), poll_interval=0.1)):
        total = sum(counts.values())
        await wait_for(lambda: history_count(queue, "done", total), what="jobs done")
    return ids


async def history_count(queue: Queue, status: str, expected: int) -> bool:
    n = await fetchval(queue, "SELECT count(*) FROM {s}.jobs_history WHERE status = %s", status)
    return bool(n == expected)


async def backdate(queue: Queue, ids: list[int], age: str) -> None:
    await execute(queue, "UPDATE {s}.jobs_history SET finished_at = now() - %s::interval"
                  " WHERE id = ANY(%s)", age, ids)


async def insert_old_history(queue: Queue, n: int, queue_name: str = "default") -> None:
    await execute(queue, "INSERT INTO {s}.jobs_history (id, queue, task, payload, status,"
                  " priority, run_at, attempts, max_attempts, created_at, finished_at)"
                  " SELECT (SELECT least(min(id), 0) FROM {s}.jobs_history) - g, %s, 'old', '{{}}',"
                  "   'done', 0, now(), 1, 3, now() - interval '3 days', now() - interval '2 days'"
                  " FROM generate_series(1, %s) g", queue_name, n)


# --- retention -------------------------------------------------------------------------------


async def test_prune_deletes_only_finished_jobs_past_their_queues_retention(
        pg_dsn: str, schema: str) -> None:
    queue = Queue(pg_dsn, schema=schema, retention=timedelta(days=1),
                  queue_retention={"short": 60, "forever": None})
    async with queue:
        await queue.install()
        ids = await finish_jobs(queue, {"default": 5, "short": 3, "forever": 2})
        d, s, f = ids["default"], ids["short"], ids["forever"]
        await backdate(queue, d[:3], "2 days")          # past the default day: deleted
        await backdate(queue, d[3:], "1 hour")          # within it: kept
        await backdate(queue, s[:2], "5 minutes")       # past short's minute: deleted
        await backdate(queue, f, "400 days")            # forever: kept
        cancelled = await queue.enqueue("noop", {}, delay=3600)
        assert await queue.cancel(cancelled)
        await backdate(queue, [cancelled], "3 days")    # cancelled is finished too: deleted
        failed = await queue.enqueue("noop", {}, delay=3600)
        await execute(queue, "UPDATE {s}.jobs SET status = 'failed',"
                      " finished_at = now() - interval '30 days' WHERE id = %s", failed)
        waiting = await queue.enqueue("noop", {}, delay=3600)
        await execute(queue, "UPDATE {s}.jobs SET created_at = now() - interval '30 days'"
                      " WHERE id = %s", waiting)

        assert await queue.prune() == {"default": 4, "short": 2}

        for gone in (*d[:3], *s[:2], cancelled):
            assert await queue.get(gone) is None
        for kept in (*d[3:], s[2], *f):
            info = await queue.get(kept)
            assert info is not None and info.status == "done"  # history stays queryable
        failed_info, waiting_info = await queue.get(failed), await queue.get(waiting)
        assert failed_info is not None and failed_info.status == "failed"
        assert waiting_info is not None and waiting_info.status == "queued"
        assert await queue.prune() == {}  # nothing left past retention

        # An explicit age overrides retention, "forever" included; failed (dead-lettered)
        # jobs go only on purpose, and only when old enough.
        assert await queue.prune(timedelta(days=60), failed=True) == {"forever": 2}
        assert await queue.get(failed) is not None
        assert await queue.prune(timedelta(days=7), failed=True) == {"default": 1}
        assert await queue.get(failed) is None
        assert (await queue.get(waiting)) is not None


async def test_prune_with_an_explicit_age_and_queue(queue: Queue) -> None:
    await insert_old_history(queue, 3, "a")
    await insert_old_history(queue, 2, "b")
    assert await queue.prune(timedelta(days=3), queue="a") == {}
    assert await queue.prune(timedelta(hours=1), queue="a") == {"a": 3}
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs_history") == 2


async def test_prune_works_in_bounded_batches(queue: Queue) -> None:
    await insert_old_history(queue, 12_000)
    policy = Retention(3600.0)
    # The workers' turn stops after max_batches; the rest waits for the next turn.
    db = queue.database
    assert await prune_history(db, policy, batch=5000, max_batches=2) == {"default": 10_000}
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs_history") == 2000
    assert await prune_history(db, policy, batch=5000, max_batches=2) == {"default": 2000}


async def test_only_one_pruner_at_a_time(queue: Queue, pg_dsn: str) -> None:
    await insert_old_history(queue, 10)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as other:
        async with other.transaction():
            await other.execute(queue.sql.pruner_lock)
            # A worker's turn skips while another worker is pruning...
            assert await prune_history(queue.database, Retention(60.0)) == {}
    # ...and works once it is done.
    assert await prune_history(queue.database, Retention(60.0)) == {"default": 10}


async def test_workers_prune_in_their_maintenance_turn(pg_dsn: str, schema: str) -> None:
    queue = Queue(pg_dsn, schema=schema, retention=3600)
    async with queue:
        await queue.install()
        await insert_old_history(queue, 7000)
        worker = Worker(queue, reap_interval=0.1, prune_interval=0.2, poll_interval=0.1)
        async with running(worker):
            await wait_for(lambda: history_count(queue, "done", 0), what="history pruned")
            assert worker.pruner is not None
            await wait_for(lambda: worker.pruner is not None and worker.pruner.pruned == 7000,
                           what="pruner's count")


@pytest.mark.parametrize("kwargs, needle", [
    ({"retention": -5}, "greater than 0"),
    ({"retention": "7d"}, "timedelta or a number of seconds"),
    ({"queue_retention": ["x"]}, "dict of queue name"),
    ({"queue_retention": {"x": timedelta(0)}}, "greater than 0"),
])
def test_bad_retention_is_refused(pg_dsn: str, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        Queue(pg_dsn, **kwargs)


async def test_bad_prune_arguments(queue: Queue) -> None:
    with pytest.raises(ConfigurationError, match="needs an age"):
        await queue.prune(failed=True)
    with pytest.raises(ConfigurationError, match="greater than 0"):
        await queue.prune(0)
    with pytest.raises(ConfigurationError):
        Worker(queue, prune_interval=0)


async def cli(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: run_cli(*args, dsn=dsn))


@pytest.mark.processes
async def test_prune_cli(queue: Queue, pg_dsn: str) -> None:
    await insert_old_history(queue, 25)
    r = await cli("prune", "--older-than", "1d", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert "deleted 25 finished job(s) older than 1d: default=25" in r.stdout
    r = await cli("prune", "--failed", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 2 and "--failed needs --older-than" in r.stderr
    assert "Traceback" not in r.stderr
    r = await cli("prune", "--older-than", "soon", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 2 and "is not a duration: use e.g. 90" in r.stderr


# --- doctor ----------------------------------------------------------------------------------


def problems(report: Report, check: str | None = None) -> list[str]:
    return [f"{f.message} | {f.advice}" for f in report.findings
            if f.level == PROBLEM and (check is None or f.check == check)]


async def server_autovacuum_off(queue: Queue) -> bool:
    return bool(await fetchval(queue, "SELECT current_setting('autovacuum') = 'off'"))


async def test_doctor_on_a_healthy_queue(queue: Queue) -> None:
    await queue.enqueue_many("t", [{"i": i} for i in range(3000)])
    await execute(queue, "ANALYZE {s}.jobs")
    report = await diagnose(queue)
    # The server's own autovacuum setting is not ours to change; doctor must say so if off.
    expected = 1 if await server_autovacuum_off(queue) else 0
    assert len(problems(report)) == expected, problems(report)
    assert len(problems(report, "autovacuum")) == expected
    [claim] = report.claims
    # The article's property: the claim reads the partial index, a handful of blocks.
    assert claim["index"] == "jobs_0_dequeue_idx" and claim["scan"] == "Index Scan", claim
    assert claim["blocks"] < 10, claim
    assert claim["rows"] == 1
    # The claim ran for real and was rolled back: nothing was claimed.
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'queued'") == 3000
    assert {t["table"] for t in report.tables} == {"jobs_0", "jobs_1", "jobs_history"}
    assert {i["index"] for i in report.indexes} >= {"jobs_dequeue_idx", "jobs_running_idx",
                                                     "jobs_0_dequeue_idx", "jobs_1_dequeue_idx"}
    [generations] = [f.message for f in report.findings if f.check == "generations"]
    assert generations.startswith(f"{queue.schema}.jobs_0 is current"), generations


async def test_doctor_explains_the_generic_plan_workers_run(queue: Queue) -> None:
    # Workers plan the claim once for any queue and limit (ownconn.py); a plan made for the
    # bound values could read the table differently, so doctor must show the generic one.
    await queue.enqueue_many("t", [{"i": i} for i in range(3000)])
    await execute(queue, "ANALYZE {s}.jobs")
    async with queue.connection() as conn:
        # After 5 runs psycopg prepares a statement of its own, and from then on it answers a
        # ROLLBACK with DEALLOCATE ALL, doctor's prepared claim included.
        for _ in range(6):
            await conn.execute("SELECT %s::int", (1,))
        for _ in range(2):  # the prepared claim is gone after each look
            claim = await explain_claim(conn, queue.database.sql_of(0), "default", limit=5)
            assert claim["generic"], claim
            assert claim["index"] == "jobs_0_dequeue_idx" and claim["rows"] == 5, claim
        cur = await conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name NOT LIKE %s", ("_pg3%",))
        assert await cur.fetchall() == []
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'queued'") == 3000


async def test_doctor_finds_a_missing_index(queue: Queue) -> None:
    await execute(queue, "DROP INDEX {s}.jobs_dequeue_idx")  # and its partitions' with it
    [found] = problems(await diagnose(queue), "indexes")
    assert "jobs_dequeue_idx" in found and "missing" in found
    for g in (0, 1):
        assert (f'CREATE INDEX CONCURRENTLY "jobs_{g}_dequeue_idx" ON "{queue.schema}".'
                f'"jobs_{g}" (queue, priority DESC, run_at, id) WHERE status = \'queued\'') \
            in found
    assert (f'CREATE INDEX "jobs_dequeue_idx" ON "{queue.schema}"."jobs"'
            " (queue, priority DESC, run_at, id) WHERE status = 'queued'") in found


async def test_doctor_gives_the_statement_that_restores_the_queue_autovacuum_settings(
        queue: Queue) -> None:
    def lacking(report: Report) -> list[str]:
        return [f.advice for f in report.findings if f.check == "autovacuum"
                and "lacks the queue autovacuum settings" in f.message]

    assert lacking(await diagnose(queue)) == []
    await execute(queue, "ALTER TABLE {s}.jobs_1 RESET (autovacuum_vacuum_scale_factor,"
                         " autovacuum_vacuum_threshold)")
    [advice] = lacking(await diagnose(queue))
    statement = advice.split(" (the settings of")[0]
    assert statement.startswith(f'ALTER TABLE "{queue.schema}".jobs_1 SET ('), advice
    async with queue.connection() as conn:
        await conn.execute(statement)  # the advice, run as given, cures it
    assert lacking(await diagnose(queue)) == []


async def test_doctor_finds_a_transaction_pinning_the_xmin_horizon(queue: Queue,
                                                                   pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(
            pg_dsn, application_name="stuck-report") as holder:
        await holder.execute("SELECT txid_current()")  # holds an xid: idle in transaction
        pid = holder.info.backend_pid

        async def pinned() -> bool:
            return bool(problems(await diagnose(queue, xmin_age=0.2), "xmin horizon"))

        await wait_for(pinned, what="doctor to see the open transaction")
        report = await diagnose(queue, xmin_age=0.2)
        [found] = problems(report, "xmin horizon")
        assert f"pid {pid} (stuck-report" in found and "idle in transaction" in found
        assert f"pg_terminate_backend({pid})" in found
        assert report.xmin_holders[0]["pid"] == pid
        await holder.rollback()
    assert not problems(await diagnose(queue, xmin_age=0.2), "xmin horizon")


async def test_doctor_finds_a_bloated_table_and_vacuum_cures_it(queue: Queue) -> None:
    # The article's experiment: without vacuum, rows that are gone keep their claim-index
    # entries and the claim wades through them.
    await execute(queue, "ALTER TABLE {s}.jobs_0 SET (autovacuum_enabled = false)")
    await queue.enqueue_many("t", [{"i": i} for i in range(20_000)])
    await execute(queue, "DELETE FROM {s}.jobs")
    await queue.enqueue("t", {"last": True})

    async def bloated() -> bool:
        return bool(problems(await diagnose(queue), "bloat"))

    await wait_for(bloated, what="statistics to show the dead rows")
    report = await diagnose(queue)
    [found] = problems(report, "bloat")
    dead = int(re.search(r"\.jobs_0 has (\d+) dead rows", found).group(1))  # type: ignore[union-attr]
    assert dead >= 20_000 and "VACUUM (ANALYZE)" in found, found
    assert any("autovacuum is disabled on" in p for p in problems(report, "autovacuum"))
    [claim] = report.claims
    assert claim["blocks"] > CLAIM_BLOCKS_PROBLEM, claim
    assert problems(report, "claim plan")

    await execute(queue, "ALTER TABLE {s}.jobs_0 RESET (autovacuum_enabled)")
    await execute(queue, "VACUUM (ANALYZE) {s}.jobs")

    async def cured() -> bool:
        return not problems(await diagnose(queue), "bloat")

    await wait_for(cured, what="statistics to show the vacuum")
    report = await diagnose(queue)
    assert not problems(report, "claim plan")
    assert report.claims[0]["blocks"] < 10, report.claims


async def test_doctor_warns_about_stale_running_jobs(queue: Queue) -> None:
    job_id = await queue.enqueue("t", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', locked_by = 'gone',"
                  " locked_at = now() - interval '10 minutes', attempts = 1 WHERE id = %s", job_id)
    [stale] = [f for f in (await diagnose(queue)).findings if f.check == "stale running"]
    assert stale.level == "warning" and "1 running job(s)" in stale.message


@pytest.mark.processes
async def test_doctor_cli(queue: Queue, pg_dsn: str) -> None:
    r = await cli("doctor", "--json", "--schema", queue.schema, dsn=pg_dsn)
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert r.returncode == (0 if report["healthy"] else 1)
    assert {f["check"] for f in report["findings"]} >= {
        "bloat", "indexes", "stale running", "xmin horizon", "notifications", "claim plan"}
    r = await cli("doctor", "--schema", queue.schema, dsn=pg_dsn)
    assert "claim plan: claim on queue 'default': Index Scan on jobs_0_dequeue_idx" in r.stdout
    await execute(queue, "DROP INDEX {s}.jobs_running_idx")
    r = await cli("doctor", "--json", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 1 and json.loads(r.stdout)["healthy"] is False
    r = await cli("doctor", "--schema", "not_installed_here", dsn=pg_dsn)
    assert r.returncode == 1 and "is not installed: run `python -m asyncjobq install`" in r.stderr


# --- vacuum of the hot table -----------------------------------------------------------------


async def vacuum_count(queue: Queue) -> int:
    return int(await fetchval(
        queue, "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
        f'"{queue.schema}".jobs_0'))


async def test_workers_vacuum_the_hot_table_between_autovacuums(queue: Queue) -> None:
    # Autovacuum comes once a minute at best; the workers do not wait for it.
    await execute(queue, "ALTER TABLE {s}.jobs_0 SET (autovacuum_enabled = false)")
    await queue.enqueue_many("t", [{"i": i} for i in range(5000)])
    await execute(queue, "DELETE FROM {s}.jobs")
    await queue.enqueue("t", {})

    async def claim_blocks() -> int:
        async with queue.connection() as conn:
            return int((await explain_claim(conn, queue.database.sql_of(0), "default"))["blocks"])

    assert await claim_blocks() > CLAIM_BLOCKS_PROBLEM // 2  # wading through 5000 dead entries
    before = await vacuum_count(queue)
    worker = Worker(queue, queues=("elsewhere",), vacuum_interval=0.2, poll_interval=0.1)
    async with running(worker):
        await wait_for(lambda: worker.vacuum is not None and worker.vacuum.vacuums >= 1,
                       what="the worker's vacuum")

    async def counted() -> bool:
        return await vacuum_count(queue) > before

    await wait_for(counted, what="the vacuum in the statistics")
    assert await claim_blocks() < 10


async def test_vacuum_can_be_left_to_autovacuum(queue: Queue) -> None:
    worker = Worker(queue, vacuum_interval=None, poll_interval=0.1)
    async with running(worker):
        assert worker.vacuum is None
    with pytest.raises(ConfigurationError, match="vacuum_interval"):
        Worker(queue, vacuum_interval=-1)


async def test_doctor_warns_of_a_paused_queue_with_jobs_and_explains_the_others(
        queue: Queue) -> None:
    await queue.enqueue_many("t", [{}] * 5, queue="held")
    await queue.enqueue_many("t", [{}] * 5, queue="flowing")
    await queue.pause("held")
    await queue.pause("empty")
    report = await diagnose(queue)
    [paused] = [f for f in report.findings if f.check == "paused queues"]
    assert paused.level == "warning" and "held (since" in paused.message, paused
    assert "resume" in paused.advice and "empty" not in paused.message
    # The paused queue's claim reads nothing, which would look healthy: not explained.
    assert [c["queue"] for c in report.claims] == ["flowing"]
    await queue.resume("held")
    [paused] = [f for f in (await diagnose(queue)).findings if f.check == "paused queues"]
    assert paused.level == "ok" and "empty" in paused.message
