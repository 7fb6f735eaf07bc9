"""Flow control's limits (issue 21): concurrency, per-key and rate limits, held
in the claim across worker processes. Handlers (tests/apps/flowapp.py) log their start and
end times to a file; every check reads what the handlers saw."""

from __future__ import annotations

import asyncio
import bisect
import importlib.util
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import (
    ROOT,
    WorkerProcess,
    execute,
    fetchval,
    run_cli,
    running,
    spawn_worker,
    wait_for,
)
from psycopg import sql

from asyncjobq import ConfigurationError, Job, Queue, Worker

APP = "apps.flowapp:queue"


class Run:
    """One line per job a handler ran: task key seq start end pid."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, task: str) -> list[tuple[str, int, float, float, int]]:
        if not self.path.exists():
            return []
        found = []
        for line in self.path.read_text().splitlines():
            t, key, seq, start, end, pid = line.split()
            if t == task:
                found.append((key, int(seq), float(start), float(end), int(pid)))
        return found


def peak_overlap(spans: list[tuple[float, float]]) -> int:
    # Ends sort before starts at the same instant: a slot handed over is not an overlap.
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@contextmanager
def workers(dsn: str, schema: str, log: Path, n: int, *args: str) -> Iterator[list[WorkerProcess]]:
    procs = [spawn_worker(dsn, schema, *args, app=APP, env={"FLOW_LOG": str(log)})
             for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.communicate(timeout=30)
            except Exception:
                p.kill()
                p.communicate(timeout=10)


async def _left(queue: Queue) -> int:
    return int(await fetchval(queue, "SELECT count(*) FROM {s}.jobs"))


async def _drained(queue: Queue, procs: list[WorkerProcess], timeout: float) -> float:
    started = time.monotonic()

    async def done() -> bool:
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].stderr_so_far()
        return await _left(queue) == 0

    await wait_for(done, timeout, interval=0.05, what="the jobs to finish")
    return time.monotonic() - started


@pytest.mark.fleet
@pytest.mark.processes
async def test_concurrency_limit_holds_across_four_processes(
        queue: Queue, pg_dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "flow.log"
    await queue.enqueue_many("limited", [{"seq": i, "sleep": 0.005} for i in range(500)])
    # Two slots a process: no one process can hold all three, so the processes race for
    # the last one all along (with more, the first to fill up keeps them: each flush that
    # ends a job claims the next in the same statement).
    with workers(pg_dsn, queue.schema, log, 4, "--concurrency", "2") as procs:
        await _drained(queue, procs, 120)
    rows = Run(log).rows("limited")
    assert len(rows) == 500
    assert peak_overlap([(s, e) for _, _, s, e, _ in rows]) == 3
    assert len({pid for *_, pid in rows}) > 1, "one process ran every job"


@pytest.mark.processes
async def test_a_killed_workers_slots_come_back_after_its_lease(
        queue: Queue, pg_dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "flow.log"
    # A first attempt sleeps past the test; the attempt after the reap finishes at once.
    await queue.enqueue_many("limited", [{"seq": i, "sleep": 600, "then": 0.005}
                                         for i in range(3)])
    await queue.enqueue_many("limited", [{"seq": 10 + i, "sleep": 0.005} for i in range(5)])
    with workers(pg_dsn, queue.schema, log, 1, "--lease", "2") as (first,):
        async def three_running() -> bool:
            return int(await fetchval(queue, "SELECT count(*) FROM {s}.jobs"
                                      " WHERE status = 'running'")) == 3
        await wait_for(three_running, 20, what="three jobs running")
        first.send_signal(signal.SIGKILL)
        killed_at = time.time()
        first.communicate(timeout=10)
    # The three slots stay taken until the lease expires and the jobs are reaped: the
    # other jobs cannot start before that, and all start after it.
    assert int(await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'running'"
                              " AND flow")) == 3
    with workers(pg_dsn, queue.schema, log, 1, "--lease", "2") as procs:
        await _drained(queue, procs, 60)
    rows = Run(log).rows("limited")
    assert sorted(seq for _, seq, *_ in rows) == [0, 1, 2, 10, 11, 12, 13, 14]
    assert peak_overlap([(s, e) for _, _, s, e, _ in rows]) <= 3
    # The dead worker's rows held the slots until their lease (2 s) was over.
    assert min(s for _, seq, s, _, _ in rows if seq >= 10) >= killed_at + 1.5
    attempts = await fetchval(queue, "SELECT array_agg(attempts ORDER BY id) FROM"
                              " {s}.jobs_history")
    assert sorted(attempts) == [1] * 5 + [2] * 3


@pytest.mark.processes
async def test_key_limit_runs_each_keys_jobs_one_at_a_time_in_order(
        queue: Queue, pg_dsn: str, tmp_path: Path) -> None:
    keys = [f"account:{k}" for k in range(20)]
    jobs = [(k, seq) for seq in range(50) for k in keys]  # interleaved, as they would arrive

    async def drain(keyed: bool) -> tuple[float, Run]:
        log = tmp_path / f"flow-{keyed}.log"
        await queue.enqueue_many(
            "keyed", [{"seq": seq, "key": k, "sleep": 0.05} for k, seq in jobs],
            keys=[k for k, _ in jobs] if keyed else None)
        with workers(pg_dsn, queue.schema, log, 4, "--concurrency", "5") as procs:
            await _drained(queue, procs, 180)
        run = Run(log)
        rows = run.rows("keyed")
        # From the first start to the last end: the processes' start-up is not the jobs'.
        return max(e for *_, e, _ in rows) - min(s for *_, s, _, _ in rows), run

    # Same jobs, same workers (4 x 5 slots: one per key), without keys and then with them.
    plain_time, _ = await drain(keyed=False)
    keyed_time, run = await drain(keyed=True)
    rows = run.rows("keyed")
    assert len(rows) == 1000
    by_key: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for key, seq, start, end, _ in rows:
        by_key[key].append((start, end, seq))
    assert sorted(by_key) == sorted(keys)
    for key, spans in by_key.items():
        spans.sort()
        assert [seq for *_, seq in spans] == list(range(50)), f"{key} started out of order"
        assert peak_overlap([(s, e) for s, e, _ in spans]) == 1, f"{key} ran two at once"
    assert peak_overlap([(s, e) for _, _, s, e, _ in rows]) > 10, "keys held each other up"
    # The keyed drain's speed against the same jobs without keys is a figure, not a check:
    # timed on a machine shared with other tests it measures them (0.7997 beside five other
    # test processes failed the >= 0.8 once asserted). The check above: keys never wait on
    # each other.
    print(f"\nkey_limit=1, 20 keys x 50 jobs, 4 processes: {keyed_time:.2f} s keyed, "
          f"{plain_time:.2f} s without keys: throughput ratio {plain_time / keyed_time:.2f}")


@pytest.mark.processes
async def test_rate_limit_is_fleet_wide(queue: Queue, pg_dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "flow.log"
    n = 250
    await queue.enqueue_many("rated", [{"seq": i, "sleep": 0.001} for i in range(n)])
    with workers(pg_dsn, queue.schema, log, 4) as procs:
        await _drained(queue, procs, 60)
    starts = sorted(s for _, _, s, _, _ in Run(log).rows("rated"))
    assert len(starts) == n
    most = max(bisect.bisect_left(starts, t + 1.0) - i for i, t in enumerate(starts))
    # The last window counted whole: the run's rate, not its last burst's.
    average = n / (starts[-1] - starts[0] + 1.0)
    print(f"\nrate_limit=50/s, 4 processes, {n} jobs: most starts in a 1 s window {most}, "
          f"average {average:.1f}/s")
    assert most <= 50
    # The limiter lets the whole rate through when the machine can: some window is (nearly)
    # full. The run's average is a looser check, for stalls of whole windows: beside the
    # suite's other processes it measured 39.7/s once, with a 50-start window in the run.
    assert most >= 45
    assert average >= 30


@pytest.mark.processes
async def test_held_jobs_burn_no_attempt_and_status_shows_limits(
        queue: Queue, pg_dsn: str, tmp_path: Path) -> None:
    log = tmp_path / "flow.log"
    await queue.enqueue_many("limited", [{"seq": i, "sleep": 0.2} for i in range(9)])
    with workers(pg_dsn, queue.schema, log, 2, "--concurrency", "10") as procs:
        await _drained(queue, procs, 60)
    attempts = await fetchval(queue, "SELECT array_agg(attempts) FROM {s}.jobs_history")
    assert attempts == [1] * 9
    out = run_cli("status", APP, dsn=pg_dsn,
                  env={"ASYNCJOBQ_TEST_SCHEMA": queue.schema, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "concurrency_limit=3" in out.stdout and "key_limit=1" in out.stdout
    assert "rate_limit=50/s" in out.stdout
    out = run_cli("status", APP, "--json", dsn=pg_dsn,
                  env={"ASYNCJOBQ_TEST_SCHEMA": queue.schema})
    assert out.returncode == 0, out.stderr
    limits = json.loads(out.stdout)["limits"]
    wrong = run_cli("status", APP, "--schema", "elsewhere", dsn=pg_dsn,
                    env={"ASYNCJOBQ_TEST_SCHEMA": queue.schema})
    assert wrong.returncode == 2 and "drop --schema" in wrong.stderr, wrong.stderr
    assert limits["limited"]["concurrency_limit"] == 3
    assert limits["limited"]["running"] == 0
    assert limits["rated"]["rate_limit"] == "50/s"


@pytest.mark.parametrize(("option", "value", "message"), [
    ("concurrency_limit", 0, "from 1 to 1000000"),
    ("key_limit", "1", "from 1 to 1000000"),
    ("rate_limit", "50 per second", '"N/s", "N/m" or "N/h"'),
    ("rate_limit", "0/s", "1 <= N"),
])
def test_bad_limits_are_refused_at_the_decorator(option: str, value: object,
                                                 message: str) -> None:
    q = Queue(schema="never_opened")
    with pytest.raises(ConfigurationError, match=message):
        q.task(name="t", **{option: value})  # type: ignore[arg-type]


async def test_bad_keys_are_refused(queue: Queue) -> None:
    @queue.task(name="k", key_limit=1)
    async def k(job: Job) -> None:
        pass

    for bad in ("", "a\x00b", 42, "x" * 1001):
        with pytest.raises(ConfigurationError, match="key="):
            await queue.enqueue("k", {}, key=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="one key"):
        await queue.enqueue_many("k", [{}, {}], keys=["a"])
    with pytest.raises(ConfigurationError, match="one key"):
        await queue.enqueue_many("k", [{}], keys="a")  # type: ignore[arg-type]
    assert await _left(queue) == 0
    ids = await queue.enqueue_many("k", [{}, {}, {}], keys=["a", None, "b"])
    assert await fetchval(queue, "SELECT array_agg(key ORDER BY id) FROM {s}.jobs") == [
        "a", None, "b"]
    assert len(ids) == 3
    assert os.environ.get("FLOW_LOG") is None


@pytest.mark.processes
async def test_the_readme_example_runs_each_accounts_transfers_in_order(
        pg_dsn: str, schema: str) -> None:
    """examples/flow_control.py (docs/guides/flow-control.md): transfers of three accounts, enqueued
    interleaved, run one at a time per account and in order by a worker of 10 slots; `status
    APP`, as its docstring says, shows the limits."""
    spec = importlib.util.spec_from_file_location(f"flow_example_{schema}",
                                                  ROOT / "examples" / "flow_control.py")
    assert spec is not None and spec.loader is not None
    old = os.environ.get("QUEUE_SCHEMA")
    os.environ["QUEUE_SCHEMA"] = schema
    try:
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
    finally:
        if old is None:
            del os.environ["QUEUE_SCHEMA"]
        else:
            os.environ["QUEUE_SCHEMA"] = old
    q: Queue = example.queue
    q.set_dsn(pg_dsn)
    async with q:
        await q.install()
        for account in (1, 2, 3):
            await example.enqueue_transfers(account, [100 + i for i in range(10)])
        async with running(Worker(q, concurrency=10)):
            await wait_for(lambda: len(example.applied) == 30, 30, what="the transfers")
    for account in (1, 2, 3):
        assert [seq for a, seq in example.applied if a == account] == list(range(10))
    env = {**os.environ, "ASYNCJOBQ_DSN": pg_dsn, "QUEUE_SCHEMA": schema}
    r = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "asyncjobq", "status",
                         "examples.flow_control:queue", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["limits"]["send_mail"]["rate_limit"] == "14/s"


async def test_a_retried_job_keeps_its_key_until_its_next_attempt_ends(queue: Queue) -> None:
    events: list[tuple[str, int, int]] = []

    @queue.task(name="step", key_limit=1, backoff=lambda n: 0.0)
    async def step(job: Job) -> None:
        events.append(("start", job.payload["seq"], job.attempt))
        await asyncio.sleep(0.02)
        events.append(("end", job.payload["seq"], job.attempt))
        if job.payload["seq"] == 0 and job.attempt == 1:
            raise RuntimeError("first attempt fails, retried at once")

    await queue.enqueue_many("step", [{"seq": i} for i in range(3)], keys=["k"] * 3)
    async with running(Worker(queue, concurrency=5)):
        await wait_for(lambda: len(events) == 8, 20, what="four attempts")
    assert events == [("start", 0, 1), ("end", 0, 1), ("start", 0, 2), ("end", 0, 2),
                      ("start", 1, 1), ("end", 1, 1), ("start", 2, 1), ("end", 2, 1)]


async def test_limits_refuse_to_run_outside_read_committed(queue: Queue) -> None:
    @queue.task(name="one", concurrency_limit=1)
    async def one(job: Job) -> None:
        pass

    await queue.enqueue("one", {})
    params = {"queue": "default", "worker": "w", "limit": 5,
              "limits": json.dumps({"one": {"c": 1}})}
    async with queue.connection() as conn:
        await conn.execute("SET default_transaction_isolation = 'repeatable read'")
        with pytest.raises(psycopg.errors.RaiseException, match="isolation level repeatable"):
            await conn.execute(queue.sql.job_claim_one_queue_limited, params)
        await conn.rollback()
        await conn.execute("SET default_transaction_isolation = 'read committed'")
        cur = await conn.execute(queue.sql.job_claim_one_queue_limited, params)
        assert len(await cur.fetchall()) == 1
        await conn.rollback()


async def test_a_key_with_more_waiting_retries_than_its_limit_still_moves(queue: Queue) -> None:
    """Two jobs of one key waiting for another attempt (run at once under an older, looser
    limit, say) with key_limit=1 now: they run again one at a time, then the key's new job."""
    events: list[tuple[str, int]] = []

    @queue.task(name="step", key_limit=1)
    async def step(job: Job) -> None:
        events.append(("start", job.payload["seq"]))
        await asyncio.sleep(0.02)
        events.append(("end", job.payload["seq"]))

    await queue.enqueue_many("step", [{"seq": i} for i in range(3)], keys=["k"] * 3)
    await execute(queue, "UPDATE {s}.jobs SET attempts = 1 WHERE (payload->>'seq')::int < 2")
    async with running(Worker(queue, concurrency=5)):
        await wait_for(lambda: len(events) == 6, 20, what="the key's three jobs")
    assert events == [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2),
                      ("end", 2)]


def test_worker_sessions_turn_jit_off(queue: Queue) -> None:
    # A generic plan of the limited claim is costed past jit_above_cost on a large table.
    assert "'jit', 'off'" in queue.sql.session_worker_plans.as_string(None)


class _ClockAhead:
    """The fetcher module's `time`, with a wall clock `ahead` seconds ahead of the database's
    (monotonic time, which alarms use, unchanged)."""

    def __init__(self, ahead: float) -> None:
        self.ahead = ahead

    def time(self) -> float:
        return time.time() + self.ahead

    def monotonic(self) -> float:
        return time.monotonic()


async def test_a_worker_clock_ahead_of_the_database_does_not_spin_on_a_rate_limit(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 item 4: the held-back claim's wait is the database's to compute. A worker 2 s
    ahead that subtracted its own clock from the rate window's end woke before the window
    freed, again and again, each claim under the task's advisory lock."""
    from asyncjobq._worker import fetcher as fetcher_module

    starts: list[float] = []

    @queue.task(name="slow", rate_limit="1/s")
    async def slow(job: Job) -> None:
        starts.append(time.monotonic())

    await queue.enqueue_many("slow", [{}] * 20)
    monkeypatch.setattr(fetcher_module, "time", _ClockAhead(2.0))
    w = Worker(queue, concurrency=5)
    async with running(w):
        fetcher = w.fetcher
        assert fetcher is not None
        claims = [0]
        real_claim, real_folded = fetcher.claim, fetcher.folded_claimed

        async def claim(limit: int) -> list[Job]:
            claims[0] += 1
            return await real_claim(limit)

        def folded_claimed(rows: list[Any], claim: Any) -> None:
            claims[0] += 1
            real_folded(rows, claim)

        fetcher.claim = claim  # type: ignore[method-assign]
        fetcher.folded_claimed = folded_claimed  # type: ignore[method-assign]
        await wait_for(lambda: len(starts) >= 1, 10, what="a first start")
        began, first = time.monotonic(), len(starts)
        await wait_for(lambda: len(starts) >= first + 3, 10, what="three more starts")
        elapsed = time.monotonic() - began
    rate = claims[0] / elapsed
    print(f"\nrate_limit=1/s, worker clock 2 s ahead: {claims[0]} claims in {elapsed:.2f} s "
          f"({rate:.0f}/s), {len(starts) - first} starts")
    # The spin was a claim after claim: 1,118/s before the fix. Not spinning, it is a few a
    # second, more on a loaded machine (each completion's flush folds in a claim): 5/s alone,
    # 11/s beside three other test processes. The bound sits far from both.
    assert rate < 50, f"{rate:.0f} claims/s for a 1/s task"
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) >= 0.9, gaps  # the limit still holds


async def test_a_worker_of_several_queues_applies_limits(queue: Queue) -> None:
    """The limited claim of several queues put its scan, ORDER BY and LIMIT included, after
    UNION ALL unparenthesised: they applied to the union, and every claim failed."""
    spans: list[tuple[float, float]] = []

    @queue.task(name="one", concurrency_limit=1)
    async def one(job: Job) -> None:
        start = time.monotonic()
        await asyncio.sleep(0.05)
        spans.append((start, time.monotonic()))

    await queue.enqueue_many(one, [{}] * 4)
    async with running(Worker(queue, queues=["default", "other"], concurrency=4)):
        await wait_for(lambda: len(spans) == 4, 10, what="the four jobs")
    assert peak_overlap(spans) == 1


async def test_a_worker_sends_only_the_limits_of_its_queues_tasks(queue: Queue) -> None:
    """Issue 31 item 5: a worker of `default` ran the limited claim, and paid for it, because
    the app had a limited task on `exports`."""
    ran: list[str] = []

    @queue.task(name="plain")
    async def plain(job: Job) -> None:
        ran.append(job.task)

    @queue.task(name="export", queue="exports", concurrency_limit=1)
    async def export(job: Job) -> None:
        ran.append(job.task)

    w = Worker(queue, queues=["default"])
    async with running(w):
        fetcher = w.fetcher
        assert fetcher is not None
        assert fetcher._limits is None
        await wait_for(lambda: fetcher.gen is not None, 10, what="the generation read")
        # The flush of jobs claimed from the current generation's partition claims from it.
        folded = fetcher.fold(gen=fetcher.gen)
        assert folded is not None
        fetcher.folded_claimed([], folded)
        st = queue.database.sql_of(fetcher.gen)
        assert folded.query in (
            st.job_set_outcome_if_running_many_then_claim_one_queue,
            st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors,
            st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors_peek)
        assert "limits" not in folded.params
        await plain.enqueue({})
        await wait_for(lambda: ran == ["plain"], 10, what="the plain job")
    w = Worker(queue, queues=["default", "exports"])
    async with running(w):
        assert w.fetcher is not None
        assert json.loads(w.fetcher._limits or "null") == {"export": {"c": 1}}
        await export.enqueue({})
        await wait_for(lambda: ran == ["plain", "export"], 10, what="the export job")


async def test_a_limited_task_is_enqueued_only_into_its_own_queue(queue: Queue) -> None:
    """A queue's workers apply the limits of the tasks declared on it: a job of a limited task
    anywhere else would run unlimited, so the API refuses to enqueue one there."""
    ran: list[int] = []

    @queue.task(name="export", queue="exports", rate_limit="1/m")
    async def export(job: Job) -> None:
        ran.append(job.id)

    fix = "task 'export' has flow limits and runs in queue 'exports'"
    with pytest.raises(ConfigurationError, match=fix):
        await queue.enqueue("export", {}, queue="default")
    with pytest.raises(ConfigurationError, match=fix):
        await export.enqueue({}, queue="default")
    with pytest.raises(ConfigurationError, match=fix):
        await queue.enqueue_many(export, [{}], queue="default")
    queue.periodic("export", every=60, queue="default")
    with pytest.raises(ConfigurationError, match=fix):
        queue.check_schedules()
    del queue.schedules["export"]
    assert await _left(queue) == 0
    own = await export.enqueue({}, queue="exports")
    stray = await fetchval(queue, "SELECT {s}.enqueue('export', '{{}}')")  # into 'default'
    async with running(Worker(queue, queues=["default", "exports"])):
        await wait_for(lambda: ran == [own], 10, what="the job in its own queue")
    # A worker serving 'default' and 'exports' sent the task's limits: the stray job, in
    # 'default', was held by the rate limit, not run unlimited.
    info = await queue.get(stray)
    assert info is not None and (info.status, info.queue) == ("queued", "default")


async def _where(queue: Queue, ids: list[int]) -> list[tuple[str, str, int, str | None]]:
    async with queue.connection() as conn:
        cur = await conn.execute(sql.SQL(
            "SELECT status::text, queue, attempts, last_error FROM {}.jobs"
            " WHERE id = ANY(%s) ORDER BY id").format(sql.Identifier(queue.schema)), (ids,))
        return [(r[0], r[1], r[2], r[3]) for r in await cur.fetchall()]


@pytest.mark.processes
async def test_a_limited_tasks_job_in_another_queue_is_moved_to_its_own(
        queue: Queue, pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    """A job of a limited task written into another queue (by the CLI, whose bare Queue does
    not know the task; from SQL; by a producer that does not register it) is claimed there by
    a worker that does not apply the task's limits. It must neither run there nor be failed
    unrun: that worker moves it to the task's queue, its attempt uncounted, and a worker of
    that queue runs it once, under the limit."""
    spans: list[tuple[float, float]] = []
    attempts: dict[int, list[int]] = defaultdict(list)

    @queue.task(name="export", queue="exports", concurrency_limit=1)
    async def export(job: Job) -> None:
        attempts[job.id].append(job.attempt)
        start = time.monotonic()
        await asyncio.sleep(0.05)
        spans.append((start, time.monotonic()))

    @queue.task(name="plain")
    async def plain(job: Job) -> None:
        pass

    cli = run_cli("enqueue", "export", "--schema", schema, dsn=pg_dsn)
    assert cli.returncode == 0, cli.stderr
    async with Queue(pg_dsn, schema=schema) as bare:  # as the CLI's: no task registered
        by_bare = [await bare.enqueue("export", {"n": n}) for n in range(3)]
    by_sql = await fetchval(queue, "SELECT {s}.enqueue('export', '{{}}')")
    strays = [int(cli.stdout), *by_bare, by_sql]
    assert [q for _, q, _, _ in await _where(queue, strays)] == ["default"] * 5
    plain_id = await plain.enqueue({})

    events: list[tuple[str, int]] = []

    class Seen:
        async def on_started(self, job: Job) -> None:
            events.append(("started", job.id))

        async def on_finished(self, job: Job, outcome: str, duration: float) -> None:
            events.append((outcome, job.id))

    queue.add_hook(Seen())
    caplog.set_level(logging.INFO, logger="asyncjobq")
    w = Worker(queue, queues=["default"], poll_interval=0.1)
    async with running(w):
        async def handled() -> bool:  # moved, or (before the fix) failed
            return all(s != "running" and (s, q) != ("queued", "default")
                       for s, q, _, _ in await _where(queue, strays))
        await wait_for(handled, 10, what="the five jobs handled")
        await wait_for(lambda: _is_gone(queue, plain_id), 10, what="the plain job done")
    assert attempts == {}
    assert await _where(queue, strays) == [("queued", "exports", 0, None)] * 5
    assert w.moved == 5
    await queue.hooks.settle(timeout=5.0)
    assert events == [("started", plain_id), ("done", plain_id)]  # moves are not attempts
    moved_lines = [r for r in caplog.records if "moved" in r.getMessage()]
    assert len(moved_lines) == 1, [r.getMessage() for r in moved_lines]  # once per task
    assert "'exports'" in moved_lines[0].getMessage()

    w = Worker(queue, queues=["exports"], concurrency=4, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: len(spans) == 5, 10, what="the five jobs run")
        await wait_for(lambda: _is_gone(queue, *strays), 10, what="the jobs done")
    assert dict(attempts) == {i: [1] for i in strays}  # each ran once, at its first attempt
    assert peak_overlap(spans) == 1


async def _is_gone(queue: Queue, *ids: int) -> bool:
    return int(await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE id = ANY(%s)",
                              list(ids))) == 0


async def test_the_move_is_fenced_on_the_attempt(queue: Queue, pg_dsn: str) -> None:
    """A move is written only while the job is still running under this worker at the attempt
    it claimed: one reaped and claimed again meanwhile (here, by this same worker) stays as
    the newer attempt left it. A move written wakes the task's queue's workers."""
    from asyncjobq._worker.misplaced import Mover

    @queue.task(name="export", queue="exports", rate_limit="5/s")
    async def export(job: Job) -> None:
        pass

    job_id = await fetchval(queue, "SELECT {s}.enqueue('export', '{{}}')")  # into 'default'
    # Attempt 1 was claimed by w-1, reaped, and attempt 2 claimed by w-1 again.
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 2,"
                  " locked_by = 'w-1', locked_at = now() WHERE id = %s", job_id)
    stale = Job(id=job_id, task="export", queue="default", payload={}, priority=0, attempt=1,
                max_attempts=3, run_at=datetime.now(UTC), created_at=datetime.now(UTC),
                worker="w-1")
    mover = Mover(queue.database, "w-1")
    assert await mover.move(stale, export) is False
    assert await _where(queue, [job_id]) == [("running", "default", 2, None)]
    assert mover.moved == 0
    # Nor by another worker.
    current = replace(stale, attempt=2)
    assert await Mover(queue.database, "w-2").move(current, export) is False
    assert await _where(queue, [job_id]) == [("running", "default", 2, None)]
    # The attempt it holds moves, uncounted, and the workers of 'exports' are woken.
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as listener:
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queue.channel)))
        assert await mover.move(current, export) is True
        got = [n async for n in listener.notifies(timeout=2.0, stop_after=1)]
    assert [json.loads(n.payload)["queue"] for n in got] == ["exports"]
    assert await _where(queue, [job_id]) == [("queued", "exports", 1, None)]
    assert await fetchval(queue, "SELECT locked_by FROM {s}.jobs WHERE id = %s", job_id) is None
    assert mover.moved == 1


async def test_a_misplaced_job_cancelled_before_its_task_starts_is_not_moved(
        queue: Queue) -> None:
    """A job of a limited task claimed in another queue is moved, not run; cancelled for a
    lost lease before its task's first step, it is neither: its row stays with the reaper."""

    @queue.task(name="export", queue="exports", concurrency_limit=1)
    async def export(job: Job) -> None:
        pass

    stray = await fetchval(queue, "SELECT {s}.enqueue('export', '{{}}')")  # into default
    w = Worker(queue, concurrency=1, poll_interval=0.1)
    dispatch = w._running.dispatch
    dispatched: list[int] = []

    def dispatch_then_cancel(job: Job) -> None:
        dispatch(job)
        r = w._running.get((job.id, job.attempt))
        assert r is not None
        r.cancel("lease lost")  # before its first step
        dispatched.append(job.id)

    w._running.dispatch = dispatch_then_cancel  # type: ignore[method-assign]
    async with running(w):
        await wait_for(lambda: bool(dispatched), timeout=10, what="the stray claimed")
        await wait_for(lambda: not w._running, timeout=10, what="its slot freed")
    assert w.moved == 0
    assert await _where(queue, [stray]) == [("running", "default", 1, None)]
