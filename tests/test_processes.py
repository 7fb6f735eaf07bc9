"""Worker processes, started as users start them, under the article's double-claim count,
SIGKILL, SIGTERM and a PostgreSQL restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest
from claims import CREATE_CLAIMS, DOUBLE_CLAIMS
from conftest import execute, fetchval, restart, running, spawn_worker, wait_for

from asyncjobq import Job, Queue, Worker

# Each test starts processes: worker or CLI processes, or a server of its own.
pytestmark = pytest.mark.processes


@pytest.fixture
async def claims_queue(queue: Queue) -> Queue:
    await execute(queue, CREATE_CLAIMS)
    return queue


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


@pytest.mark.fleet
@pytest.mark.timeout(300)
async def test_four_processes_never_double_claim(claims_queue: Queue, pg_dsn: str) -> None:
    q = claims_queue
    await q.enqueue_many("log", [{"n": i} for i in range(5000)])
    procs = [spawn_worker(pg_dsn, q.schema, "--concurrency", "10", "--batch", "10")
             for _ in range(4)]
    try:
        await wait_for(lambda: fetchval(q, "SELECT count(*) = 0 FROM {s}.jobs"), timeout=240,
                       interval=0.2, what="5,000 jobs drained")
        assert await fetchval(q, DOUBLE_CLAIMS) == 0
        assert await fetchval(q, "SELECT count(*) FROM {s}.claims") == 5000
        assert await fetchval(q, "SELECT count(DISTINCT pid) FROM {s}.claims") >= 2
        assert (await q.stats())["default"]["done"] == 5000
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert "Traceback" not in err
    finally:
        stop_all(procs)


async def killed_while_running(q: Queue, pg_dsn: str, procs: list[Any]) -> Any:
    """Worker A (lease 2 s) claims the one job enqueued and is SIGKILLed while it runs it."""
    a = spawn_worker(pg_dsn, q.schema, "--lease", "2")
    procs.append(a)
    await wait_for(lambda: fetchval(q, "SELECT count(*) = 1 FROM {s}.claims"), timeout=30,
                   what="worker A running the job")
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    return a


@pytest.mark.fleet
@pytest.mark.timeout(120)
async def test_sigkilled_worker_job_is_reaped_and_completed_elsewhere(
        claims_queue: Queue, pg_dsn: str) -> None:
    q = claims_queue
    job_id = await q.enqueue("sleep", {"by_attempt": [60, 0.1]})
    procs: list[Any] = []
    try:
        a = await killed_while_running(q, pg_dsn, procs)
        assert (await q.get(job_id)).status == "running"  # type: ignore[union-attr]
        b = spawn_worker(pg_dsn, q.schema, "--lease", "2")
        procs.append(b)
        await wait_for(lambda: status_is(q, job_id, "done"), timeout=60, what="job done by B")
        rows = await fetchval(q, "SELECT array_agg(pid ORDER BY attempt) FROM {s}.claims")
        assert rows == [a.pid, b.pid]
        info = await q.get(job_id)
        assert info is not None and info.attempts == 2 and info.last_error is not None
        assert "lease expired" in info.last_error
        assert await fetchval(q, DOUBLE_CLAIMS) == 0
    finally:
        stop_all(procs)


@pytest.mark.timeout(120)
async def test_a_cancel_for_a_sigkilled_workers_job_takes_effect_when_it_is_reaped(
        claims_queue: Queue, pg_dsn: str) -> None:
    """Queue.cancel of a job whose worker was killed: nobody hears it, the reaper cancels the
    job when its lease runs out, and it never runs again."""
    q = claims_queue
    job_id = await q.enqueue("sleep", {"seconds": 60})
    procs: list[Any] = []
    try:
        await killed_while_running(q, pg_dsn, procs)
        assert await q.cancel(job_id)
        b = spawn_worker(pg_dsn, q.schema, "--lease", "2")
        procs.append(b)
        info = await q.wait(job_id, timeout=60)
        assert info.status == "cancelled" and info.attempts == 1, info
        assert "cancelled, as asked" in (info.last_error or "")
        assert await fetchval(q, "SELECT count(*) FROM {s}.claims") == 1  # no rerun
    finally:
        stop_all(procs)


@pytest.mark.timeout(120)
async def test_a_worker_logs_json_lines_naming_the_job(claims_queue: Queue, pg_dsn: str) -> None:
    q = claims_queue
    said = await q.enqueue("say", {"word": "hello"})
    unknown = await q.enqueue("no_such_task", {})
    w = spawn_worker(pg_dsn, q.schema, "--log-format", "json", "--log-level", "info")
    try:
        for job_id in (said, unknown):
            await q.wait(job_id, timeout=60)
        w.send_signal(signal.SIGTERM)
        _, err = w.communicate(timeout=60)
    finally:
        stop_all([w])
    lines = [json.loads(line) for line in err.splitlines()]  # every line is one object
    assert lines and all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
    worker_id = next(x["worker"] for x in lines if "worker" in x)
    assert all(x.get("worker") == worker_id for x in lines if x["logger"].startswith("asyncjobq"))
    # The handler's own line, from its thread, and the worker's line about the unknown task.
    (own,) = [x for x in lines if x["logger"] == "testapp"]
    assert (own["message"], own["job_id"], own["task"], own["queue"], own["attempt"]) == (
        "saying hello", said, "say", "default", 1)
    (failed,) = [x for x in lines if "unknown task" in x["message"]]
    assert (failed["job_id"], failed["task"], failed["level"]) == (
        unknown, "no_such_task", "warning")


async def status_is(q: Queue, job_id: int, status: str) -> bool:
    info = await q.get(job_id)
    return info is not None and info.status == status


@pytest.mark.timeout(120)
async def test_sigterm_with_jobs_in_flight_leaves_nothing_running(
        claims_queue: Queue, pg_dsn: str) -> None:
    q = claims_queue
    ids = await q.enqueue_many("sleep", [{"seconds": 60} for _ in range(5)])
    quick = await q.enqueue_many("sleep", [{"seconds": 0.3} for _ in range(3)])
    w = spawn_worker(pg_dsn, q.schema, "--shutdown-timeout", "1", "--concurrency", "8")
    try:
        await wait_for(lambda: fetchval(q, "SELECT count(*) = 8 FROM {s}.claims"), timeout=30,
                       what="eight jobs running")
        t0 = time.monotonic()
        w.send_signal(signal.SIGTERM)
        _, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
        assert time.monotonic() - t0 < 10
        assert "Traceback" not in err
        assert await fetchval(q, "SELECT count(*) FROM {s}.jobs WHERE status = 'running'") == 0
        for i in ids:
            info = await q.get(i)
            assert info is not None and info.status == "queued"
            assert info.last_error and "interrupted by worker shutdown" in info.last_error
        for i in quick:  # finished within shutdown_timeout: written as done
            assert await status_is(q, i, "done")
    finally:
        stop_all([w])


@pytest.mark.timeout(180)
async def test_worker_survives_a_postgresql_restart(private_server: Any) -> None:
    dsn = private_server.get_uri()
    q = Queue(dsn, schema="restart_test")
    ran: list[int] = []

    @q.task(name="r")
    async def r(job: Job) -> None:
        ran.append(job.id)

    async with q:
        await q.install()
        w = Worker(q, poll_interval=30, lease=5)
        async with running(w):
            await wait_for(lambda: w.listener is not None and w.listener.connected.is_set())
            await r.enqueue({})
            await wait_for(lambda: len(ran) == 1, what="job before the restart")
            for n, mode in enumerate(("fast", "immediate"), start=2):
                restart(private_server, mode)
                await wait_for(lambda n=n: w.listener is not None and w.listener.connects >= n
                               and w.listener.backend_pid is not None, timeout=60,
                               what=f"LISTEN back after {mode} restart")
                # Enqueue through the pool (its dead connections are replaced), and the
                # notification, not the 30 s poll, must wake the worker.
                await wait_for(lambda: enqueue_ok(q), timeout=30, what="enqueue after restart")
                t0 = time.monotonic()
                await wait_for(lambda n=n: len(ran) == n, timeout=10, what="job after restart")
                assert time.monotonic() - t0 < 5


async def enqueue_ok(q: Queue) -> bool:
    import psycopg

    try:
        await q.enqueue("r", {})
    except psycopg.OperationalError:
        return False
    return True


@pytest.mark.timeout(60)
async def test_second_signal_exits_at_once(claims_queue: Queue, pg_dsn: str) -> None:
    q = claims_queue
    await q.enqueue("sleep", {"seconds": 60})
    w = spawn_worker(pg_dsn, q.schema, "--shutdown-timeout", "60", "--log-level", "info")
    try:
        await wait_for(lambda: fetchval(q, "SELECT count(*) = 1 FROM {s}.claims"), timeout=30,
                       what="job running")
        w.send_signal(signal.SIGTERM)
        await wait_for(lambda: fetchval(q, "SELECT true"), timeout=1)  # let it start stopping
        t0 = time.monotonic()
        w.send_signal(signal.SIGINT)
        _, err = w.communicate(timeout=10)
        assert time.monotonic() - t0 < 5
        assert w.returncode != 0
        assert "loop=uvloop" in err  # the CLI runs workers on uvloop when it is installed
    finally:
        stop_all([w])


@pytest.mark.fleet
@pytest.mark.timeout(300)
async def test_a_fan_in_finished_by_four_processes_releases_its_child_once(
        claims_queue: Queue, pg_dsn: str) -> None:
    """Parents finished by 4 worker processes at once, their outcomes racing to release the
    one child: it runs exactly once, after every parent (benchmarks/workflows.py runs 10,000
    parents 20 times)."""
    q = claims_queue
    procs = [spawn_worker(pg_dsn, q.schema, "--concurrency", "10", "--batch", "10")
             for _ in range(4)]
    try:
        for _ in range(3):
            wf = q.workflow()
            parents = [wf.add("log", {"n": i}) for i in range(1500)]
            wf.add("log", {"fan": "in"}, after=parents)
            ids = await wf.enqueue()
            child = ids[-1]
            info = await q.wait(child, timeout=240)
            assert info.status == "done"
            assert await fetchval(q, "SELECT count(*) FROM {s}.claims WHERE job_id = %s",
                                  child) == 1
            assert await fetchval(
                q, "SELECT max(h.finished_at) <= (SELECT at FROM {s}.claims WHERE job_id = %s)"
                   " FROM {s}.jobs_history h WHERE h.id = ANY(%s)", child, ids[:-1])
        assert await fetchval(q, DOUBLE_CLAIMS) == 0
        assert await fetchval(q, "SELECT count(DISTINCT pid) FROM {s}.claims") >= 2
    finally:
        stop_all(procs)


@pytest.mark.fleet
@pytest.mark.timeout(300)
async def test_a_diamond_under_sigkill_runs_its_last_job_once_after_both_parents(
        claims_queue: Queue, pg_dsn: str) -> None:
    """a -> (b, c) -> d, three diamonds, the worker running b killed -9 mid-run: b is reaped
    and rerun elsewhere, and each d runs once, after its b and c are done."""
    q = claims_queue
    diamonds = []
    for _ in range(3):
        wf = q.workflow()
        a = wf.add("log", {"step": "a"})
        b = wf.add("sleep", {"by_attempt": [60, 0.2]}, after=[a])
        c = wf.add("sleep", {"seconds": 0.2}, after=[a])
        wf.add("log", {"step": "d"}, after=[b, c])
        diamonds.append(await wf.enqueue())
    procs: list[Any] = []
    try:
        victim = spawn_worker(pg_dsn, q.schema, "--lease", "2")
        procs.append(victim)
        bs = [d[1] for d in diamonds]
        await wait_for(lambda: fetchval(
            q, "SELECT count(*) = 3 FROM {s}.claims WHERE job_id = ANY(%s)", bs),
            timeout=60, what="every b running in the victim")
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        procs += [spawn_worker(pg_dsn, q.schema, "--lease", "2") for _ in range(2)]
        for a, b, c, d in diamonds:
            assert (await q.wait(d, timeout=120)).status == "done"
            assert (await q.get(d)).parents == (b, c)  # type: ignore[union-attr]
            assert await fetchval(q, "SELECT count(*) FROM {s}.claims WHERE job_id = %s",
                                  d) == 1
            assert await fetchval(q, "SELECT count(*) FROM {s}.claims WHERE job_id = %s",
                                  b) == 2  # killed, then reaped and run again
            assert await fetchval(
                q, "SELECT max(h.finished_at) <= (SELECT at FROM {s}.claims WHERE job_id = %s)"
                   " FROM {s}.jobs_history h WHERE h.id = ANY(%s) AND h.status = 'done'",
                d, [a, b, c])
        assert await fetchval(q, DOUBLE_CLAIMS) == 0
    finally:
        stop_all(procs)
