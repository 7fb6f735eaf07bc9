"""Fault drills (issue: faults and bad input): 3 worker processes, thousands of jobs, a fault;
at the end every job done, none lost, no (job_id, attempt) executed twice."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

import psycopg
import pytest
from conftest import execute, fetchval, restart, wait_for
from drills import Drill, assert_all_alive, assert_clean, backends, no_tracebacks
from psycopg import sql

from asyncjobq import Queue

# Each test starts processes: worker or CLI processes, or a server of its own.
pytestmark = pytest.mark.processes

WORKER_APPS = ("asyncjobq-worker", "asyncjobq-worker-listen", "asyncjobq-worker-heartbeat")


@pytest.mark.timeout(240)
async def test_repeated_sigkill(queue: Queue, pg_dsn: str) -> None:
    drill = Drill(queue, pg_dsn, "repeated SIGKILL (10 kills, 0.5 s apart)", jobs=3000,
                  seconds=0.05)
    await drill.setup()
    try:
        for _ in range(3):
            drill.start_worker()
        await wait_for(lambda: fetchval(queue, "SELECT count(*) > 100 FROM {s}.claims"),
                       timeout=60, what="work under way")
        rng = random.Random(7)
        for _ in range(10):
            await asyncio.sleep(0.5)  # the fault's cadence, not a wait for a condition
            victim = rng.choice(drill.live())
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            drill.start_worker()
        drill.fault_ended = time.monotonic()
        assert not await drill.finished(), "the drill ended before the faults did"
        result = await drill.drain()
        assert_clean(result)
        assert result.reexecutions > 0  # the killed workers' jobs really ran again
    finally:
        no_tracebacks([o for o in drill.stop() if o[0] != -signal.SIGKILL])


@pytest.mark.timeout(300)
async def test_postgresql_restart_fast_and_immediate(private_server: Any, schema: str) -> None:
    dsn = private_server.get_uri()
    async with Queue(dsn, schema=schema) as q:
        await q.install()
        drill = Drill(q, dsn, "PostgreSQL restart (fast, then immediate)", jobs=3000,
                      seconds=0.05)
        await drill.setup()
        try:
            for _ in range(3):
                drill.start_worker("--poll-interval", "30")
            for mode, share in (("fast", 0.2), ("immediate", 0.5)):
                await wait_for(lambda s=share: executed_share(drill, s), timeout=60,
                               what=f"{share:.0%} executed")
                restart(private_server, mode)
            drill.fault_ended = time.monotonic()
            result = await retry_on_restart(drill.drain)
            assert_clean(result)
            assert_all_alive(drill)
            # LISTEN is back in every worker: a new job is picked up by notification, long
            # before the 30 s poll.
            await wait_for(lambda: listeners(q, 3), timeout=30, what="3 LISTEN connections")
            t0 = time.monotonic()
            job_id = await q.enqueue("sleep", {"seconds": 0})
            await wait_for(lambda: done(q, job_id), timeout=10, what="wake-up after restart")
            assert time.monotonic() - t0 < 5
        finally:
            no_tracebacks(drill.stop())


async def executed_share(drill: Drill, share: float) -> bool:
    try:
        return await drill.executed() >= drill.jobs * share
    except psycopg.OperationalError:
        return False


async def retry_on_restart(fn: Any) -> Any:
    for _ in range(20):
        try:
            return await fn()
        except psycopg.OperationalError:
            await asyncio.sleep(0.5)  # our own pool's connections died in the restart
    return await fn()


async def started(drill: Drill, n: int) -> bool:
    """All n workers past their start-up; one that exited fails at once, saying why."""
    assert_all_alive(drill)
    return await listeners(drill.queue, n)


async def listeners(q: Queue, n: int) -> bool:
    count = await fetchval(q, "SELECT count(*) FROM pg_stat_activity"
                           " WHERE datname = current_database()"
                           " AND application_name = 'asyncjobq-worker-listen'")
    return bool(count == n)


async def done(q: Queue, job_id: int) -> bool:
    info = await q.get(job_id)
    return info is not None and info.status == "done"


@pytest.mark.timeout(240)
async def test_backend_kill_storm(queue: Queue, pg_dsn: str) -> None:
    drill = Drill(queue, pg_dsn, "pg_terminate_backend storm (every 200 ms for 10 s)",
                  jobs=4000, seconds=0.05)
    await drill.setup()
    try:
        for _ in range(3):
            drill.start_worker()
        # All three past their start-up: one whose start-up connection the storm ended exits
        # (it fails fast, as a start-up does; a CI run under load met it).
        await wait_for(lambda: started(drill, 3), timeout=60, what="3 workers started")
        await wait_for(lambda: fetchval(queue, "SELECT count(*) > 100 FROM {s}.claims"),
                       timeout=60, what="work under way")
        killed = 0
        storm_end = time.monotonic() + 10
        while time.monotonic() < storm_end:
            killed += int(await fetchval(queue, "SELECT count(pg_terminate_backend(pid))"
                                         f" FROM ({backends(*WORKER_APPS)}) b"))
            await asyncio.sleep(0.2)  # the storm's cadence
        drill.fault_ended = time.monotonic()
        assert killed > 50
        result = await drill.drain()
        assert_clean(result)
        assert_all_alive(drill)
    finally:
        no_tracebacks(drill.stop())


@pytest.mark.timeout(240)
async def test_pool_exhaustion(private_server: Any, schema: str) -> None:
    """Every connection slot of the server taken: on a server of its own, since the test's
    neighbours (pytest-xdist's other workers) would lose theirs too."""
    dsn = private_server.get_uri()
    async with Queue(dsn, schema=schema) as queue:
        await queue.install()
        await _pool_exhaustion(queue, dsn)


async def _pool_exhaustion(queue: Queue, pg_dsn: str) -> None:
    drill = Drill(queue, pg_dsn, "connections exhausted for 5 s", jobs=2000, seconds=0.05)
    await drill.setup()
    hogs: list[psycopg.AsyncConnection[Any]] = []
    try:
        for _ in range(3):
            drill.start_worker()
        await wait_for(lambda: started(drill, 3), timeout=60, what="3 workers started")
        await wait_for(lambda: fetchval(queue, "SELECT count(*) > 100 FROM {s}.claims"),
                       timeout=60, what="work under way")
        # Other clients take every free connection slot...
        while True:
            try:
                hogs.append(await psycopg.AsyncConnection.connect(pg_dsn, connect_timeout=5))
            except psycopg.OperationalError as e:
                assert "too many" in str(e) or "remaining connection slots" in str(e), e
                break
        # ...and the workers lose theirs: every reconnection is refused.
        await execute(queue, f"SELECT pg_terminate_backend(pid) FROM ({backends(*WORKER_APPS)}) b")
        await asyncio.sleep(5)  # the outage
        # Release all but a few of the hogs: the workers must recover and drain.
        for conn in hogs[3:]:
            await conn.close()
        drill.fault_ended = time.monotonic()
        result = await drill.drain()
        assert_clean(result)
        assert_all_alive(drill)
    finally:
        for conn in hogs:
            await conn.close()
        outputs = drill.stop()
        no_tracebacks(outputs)
    logs = "".join(err for _, err in outputs)
    assert "too many clients" in logs or "connection slots" in logs or \
        "no database connection became available" in logs, logs[-2000:]


@pytest.mark.timeout(240)
async def test_idle_in_transaction_holding_xmin(queue: Queue, pg_dsn: str) -> None:
    drill = Drill(queue, pg_dsn, "idle in transaction holding an XID for 30 s", jobs=3000,
                  seconds=0.01)
    await drill.setup()
    blocker = await psycopg.AsyncConnection.connect(pg_dsn)
    try:
        await blocker.execute("SELECT txid_current()")  # holds an XID: vacuum cannot clean
        for _ in range(3):
            drill.start_worker()
        await wait_for(lambda: fetchval(queue, "SELECT count(*) > 100 FROM {s}.claims"),
                       timeout=60, what="work under way")
        # Jobs keep flowing while the horizon is pinned.
        before = await drill.executed()
        await asyncio.sleep(30)  # the idle-in-transaction phase
        assert await drill.executed() > before
        await blocker.rollback()
        drill.fault_ended = time.monotonic()
        result = await drill.drain()
        assert_clean(result)
        assert result.reexecutions == 0
    finally:
        await blocker.close()
        no_tracebacks(drill.stop())


@pytest.mark.fleet
@pytest.mark.timeout(240)
async def test_lost_lease_is_fenced(queue: Queue, pg_dsn: str) -> None:
    """A worker cut off from the database for longer than the lease: its jobs are reaped and
    finished elsewhere. The cut-off worker, whose heartbeats stopped landing, cancels its own
    handlers once a lease has passed (the fleet presumes it dead): nothing of it is written."""
    role = f"{queue.schema}_cut"
    drill = Drill(queue, pg_dsn, "one worker cut off for 3x the lease", jobs=300, seconds=0.05)
    await drill.setup()
    await execute(queue, f"CREATE ROLE {role} LOGIN")
    await execute(queue, f"GRANT USAGE ON SCHEMA {{s}} TO {role}")
    await execute(queue, f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {{s}}"
                  f" TO {role}")
    # The cut-off worker takes long jobs, so that they are in its hands when the cut comes.
    slow = await drill.enqueue_extra(5, {"seconds": 8}, queue="slow")
    try:
        cut_dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=role)
        cut = drill.start_worker("--queue", "slow", "--concurrency", "5",
                                 env={"ASYNCJOBQ_DSN": cut_dsn})
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 5 FROM {s}.claims"),
                       timeout=30, what="the slow jobs running on the cut-off worker")
        await execute(queue, f"ALTER ROLE {role} NOLOGIN")
        await execute(queue, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                      " WHERE datname = current_database() AND usename = %s", role)
        for _ in range(2):
            drill.start_worker("--queue", "slow", "--queue", "default")
        # The others reap the slow jobs after the lease and finish them (attempt 2).
        await wait_for(lambda: all_done(queue, slow), timeout=60, what="slow jobs done elsewhere")
        await execute(queue, f"ALTER ROLE {role} LOGIN")
        drill.fault_ended = time.monotonic()
        result = await drill.drain()
        assert_clean(result)
        # The cut worker gave its attempts up when no heartbeat had landed for a lease.
        await wait_for(lambda: lease_loss_logged(drill, cut), timeout=30,
                       what="the cut-off worker cancelling its handlers")
        assert cut.poll() is None
        pids = await fetchval(queue, "SELECT array_agg(DISTINCT pid) FROM {s}.claims c"
                              " WHERE c.attempt = 1 AND c.job_id = ANY(%s)", slow)
        assert pids == [cut.pid]
    finally:
        outputs = drill.stop()
        await execute(queue, f"DROP OWNED BY {role}")
        await execute(queue, f"DROP ROLE {role}")
    no_tracebacks(outputs)


async def all_done(q: Queue, ids: list[int]) -> bool:
    for i in ids:
        if not await done(q, i):
            return False
    return True


def lease_loss_logged(drill: Drill, proc: Any) -> bool:
    return drill.stderr(proc).count("presuming the lease lost") >= 5


@pytest.mark.timeout(240)
async def test_sigterm_under_load(queue: Queue, pg_dsn: str) -> None:
    drill = Drill(queue, pg_dsn, "SIGTERM to all workers under load", jobs=3000, seconds=0.05)
    await drill.setup()
    long_ids = await drill.enqueue_extra(6, {"by_attempt": [60, 0.01]}, priority=10)
    try:
        first = [drill.start_worker("--shutdown-timeout", "2") for _ in range(3)]
        await wait_for(lambda: fetchval(queue, "SELECT count(*) > 300 FROM {s}.claims"),
                       timeout=60, what="work under way")
        assert await fetchval(queue, "SELECT count(*) FROM {s}.claims WHERE job_id = ANY(%s)",
                              long_ids) == 6
        t0 = time.monotonic()
        for p in first:
            p.send_signal(signal.SIGTERM)
        for p in first:
            p.wait(timeout=30)
            assert p.returncode == 0
        assert time.monotonic() - t0 < 2 + 8
        assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'running'") == 0
        for i in long_ids:
            info = await queue.get(i)
            assert info is not None and info.status == "queued", info
            assert info.last_error and "interrupted by worker shutdown" in info.last_error
        for _ in range(3):
            drill.start_worker()
        drill.fault_ended = time.monotonic()
        result = await drill.drain()
        assert_clean(result)
        for i in long_ids:  # the interrupted attempt's note survives the successful retry
            info = await queue.get(i)
            assert info is not None and info.last_error and "interrupted" in info.last_error
    finally:
        no_tracebacks(drill.stop())


@pytest.mark.timeout(120)
async def test_handler_blocking_the_loop(queue: Queue, pg_dsn: str) -> None:
    # 10 s, 5 leases: the fleet takes the job back from 5/3 to 2 leases (and a reaper turn)
    # into the block (heartbeat.py, _watch_loop), with room for a loaded machine.
    drill = Drill(queue, pg_dsn, "handler blocks the event loop for 5x the lease", jobs=500,
                  seconds=0.01)
    await drill.setup()
    blocked = await queue.enqueue("block", {"by_attempt": [10, 0]}, queue="blocking")
    drill.jobs += 1
    try:
        blocker = drill.start_worker("--queue", "blocking")
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 1 FROM {s}.claims"
                                        " WHERE job_id = %s", blocked), timeout=30,
                       what="the blocking job running")
        # A loop blocked for a lease stops its heartbeats: another worker's reaper takes the
        # job back and another worker runs it, while the blocker's loop is still blocked.
        for _ in range(2):
            drill.start_worker("--queue", "default", "--queue", "blocking")
        await wait_for(lambda: done(queue, blocked), timeout=60, what="blocking job done")
        drill.fault_ended = time.monotonic()
        result = await drill.drain()
        assert_clean(result)
        async with queue.connection() as conn:
            cur = await conn.execute(sql.SQL("SELECT attempt, pid FROM {}.claims WHERE job_id = %s"
                                             " ORDER BY attempt").format(
                                                 sql.Identifier(queue.schema)), (blocked,))
            runs = await cur.fetchall()
        assert [a for a, _ in runs] == [1, 2] and runs[0][1] == blocker.pid != runs[1][1]
        info = await queue.get(blocked)
        assert info is not None and info.attempts == 2 and info.last_error is not None
        assert "attempt 1: lease expired" in info.last_error
        # The blocked attempt's own outcome, once its loop came back, was refused.
        await wait_for(lambda: "refused" in drill.stderr(blocker)
                       and "event loop running again" in drill.stderr(blocker), timeout=30,
                       what="the blocker's loop back and its late outcome refused")
        blocker.send_signal(signal.SIGTERM)
        returncode, err = drill.wait(blocker)
        assert returncode == 0
        assert "ERROR asyncjobq.heartbeat: event loop blocked" in err, err[-3000:]
        assert "a job's handler at apps/testapp.py:" in err and "in block_job" in err, err[-3000:]
        assert "event loop running again" in err, err[-3000:]
    finally:
        no_tracebacks(drill.stop())
