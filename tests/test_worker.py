"""Worker behaviour in one process: outcomes, retries, timeout, order, heartbeat, fencing,
notifications and reconnection."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
import pytest
from conftest import execute, fetchval, running, wait_for
from psycopg import sql

import asyncjobq
from asyncjobq import Fail, Job, Queue, Retry, Worker
from asyncjobq._db.sql.claim import (
    ANY_OUTCOMES,
    DONE_OUTCOMES,
    LOCKED_DONE_OUTCOMES,
    PLAIN_OUTCOMES,
)
from asyncjobq._maintenance.reaper import Reaper
from asyncjobq._worker.completer import Completer, outcomes_of
from asyncjobq._worker.fetcher import Fetcher
from asyncjobq._worker.outcome import Outcome
from asyncjobq.doctor import explain_claim


def claimer(queue: Queue, queues: list[str], batch: int) -> Fetcher:
    """A fetcher for calling claim() directly: `batch` slots, always free. It claims from
    jobs_0, the current generation of a new schema, as a worker does once it has read it."""
    f = Fetcher(queue.database, "w", queues, batch_size=batch, concurrency=batch,
                poll_interval=1, free_slots=lambda: batch, dispatch=lambda j: None)
    f.gen = 0
    return f


async def status_of(queue: Queue, job_id: int) -> str:
    info = await queue.get(job_id)
    assert info is not None
    return info.status


async def test_runs_async_and_sync_handlers(queue: Queue) -> None:
    seen: list[tuple[str, int]] = []

    @queue.task(name="a")
    async def a(job: Job) -> None:
        seen.append(("a", job.payload["n"]))

    @queue.task(name="s")
    def s(job: Job) -> str:
        seen.append(("s", job.payload["n"]))
        return "return values are ignored"

    ids = [await a.enqueue({"n": 1}), await s.enqueue({"n": 2})]
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, ids), what="both jobs done")
    assert sorted(seen) == [("a", 1), ("s", 2)]
    info = await queue.get(ids[0])
    assert info is not None and info.finished_at is not None and info.attempts == 1


async def all_done(queue: Queue, ids: list[int], status: str = "done") -> bool:
    for i in ids:
        info = await queue.get(i)
        if info is None or info.status != status:
            return False
    return True


async def test_retry_sequence_ends_failed_with_last_error(queue: Queue) -> None:
    attempts: list[int] = []

    @queue.task(name="boom", max_attempts=3, backoff=lambda n: 0.05 * n)
    async def boom(job: Job) -> None:
        attempts.append(job.attempt)
        raise RuntimeError(f"n={job.payload['n']} always fails")

    job_id = await boom.enqueue({"n": 7})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, [job_id], "failed"), what="job failed")
    assert attempts == [1, 2, 3]
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 3 and info.finished_at is not None
    assert info.last_error is not None
    assert "attempt 3: RuntimeError: n=7 always fails" in info.last_error
    assert "attempt 1:" in info.last_error  # the history of attempts is kept
    # The dead letter can be requeued and then succeeds once the cause is gone.
    queue.tasks.pop("boom")

    @queue.task(name="boom")
    async def fixed(job: Job) -> None: ...

    assert await queue.retry_failed() == 1
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, [job_id]), what="retried job done")


async def test_default_backoff_pushes_run_at_out(queue: Queue) -> None:
    @queue.task(name="once", max_attempts=5)
    async def once(job: Job) -> None:
        raise ValueError("nope")

    job_id = await once.enqueue({})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: fetchval(queue, "SELECT attempts = 1 AND status = 'queued'"
                                        " FROM {s}.jobs WHERE id = %s", job_id), what="retry")
    delay = await fetchval(queue, "SELECT extract(epoch FROM run_at - now()) FROM {s}.jobs"
                           " WHERE id = %s", job_id)
    assert 1.0 < float(delay) <= 2.2  # min(300, 2 ** 1) s plus at most 10 % jitter


async def test_retry_and_fail_signals(queue: Queue) -> None:
    calls: list[int] = []

    @queue.task(name="snooze", max_attempts=1)
    async def snooze(job: Job) -> None:
        calls.append(job.attempt)
        if len(calls) < 3:
            raise Retry(delay=0.05)

    @queue.task(name="fail", max_attempts=5)
    async def fail(job: Job) -> None:
        raise Fail("bad input, do not retry")

    s_id, f_id = await snooze.enqueue({}), await fail.enqueue({})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, [s_id]), what="snoozed job done")
        await wait_for(lambda: all_done(queue, [f_id], "failed"), what="failed job")
    # Retry does not count as an error: max_attempts=1 and it still ran three times.
    assert calls == [1, 2, 3]
    s = await queue.get(s_id)
    assert s is not None and s.last_error is None
    f = await queue.get(f_id)
    assert f is not None and f.attempts == 1 and f.last_error is not None
    assert "Fail: bad input, do not retry" in f.last_error


async def test_timeout_is_a_failed_attempt(queue: Queue) -> None:
    @queue.task(name="slow", timeout=0.2, max_attempts=1)
    async def slow(job: Job) -> None:
        await anyio.sleep(30)

    @queue.task(name="slow_sync", timeout=0.2, max_attempts=1)
    def slow_sync(job: Job) -> None:
        time.sleep(1)

    ids = [await slow.enqueue({}), await slow_sync.enqueue({})]
    started = time.monotonic()
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, ids, "failed"), what="timed out jobs")
    assert time.monotonic() - started < 10
    for i in ids:
        info = await queue.get(i)
        assert info is not None and info.last_error is not None
        assert "timed out after 0.2 s" in info.last_error


async def test_unknown_task_and_bad_handlers_do_not_stop_the_worker(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    @queue.task(name="exit", max_attempts=1)
    async def exits(job: Job) -> None:
        raise SystemExit(3)

    @queue.task(name="cancelled", max_attempts=1)
    async def cancels(job: Job) -> None:
        raise asyncio.CancelledError()

    @queue.task(name="unstorable", max_attempts=1)
    async def unstorable(job: Job) -> None:
        raise ValueError("NUL \x00 and a lone surrogate \udc80")  # PostgreSQL takes neither

    @queue.task(name="ok")
    async def ok(job: Job) -> int:
        return 42

    bad = [await queue.enqueue("nobody.handles.this", {}), await exits.enqueue({}),
           await cancels.enqueue({}), await unstorable.enqueue({})]
    good = await ok.enqueue({})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, bad, "failed"), what="bad jobs failed")
        await wait_for(lambda: all_done(queue, [good]), what="good job done")
    unknown = await queue.get(bad[0])
    assert unknown is not None and unknown.last_error is not None
    assert "unknown task 'nobody.handles.this'" in unknown.last_error
    assert "'cancelled', 'exit', 'ok', 'unstorable'" in unknown.last_error  # registered
    # Someone reading only the worker's log sees every failure too.
    assert f"job {bad[0]}: unknown task 'nobody.handles.this'" in caplog.text
    escaped = await queue.get(bad[3])
    assert escaped is not None and escaped.last_error is not None
    assert "ValueError: NUL \\x00 and a lone surrogate \\udc80" in escaped.last_error


async def test_priority_then_run_at_order(queue: Queue) -> None:
    order: list[str] = []

    @queue.task(name="rec")
    async def rec(job: Job) -> None:
        order.append(job.payload["name"])

    now = datetime.now(UTC)
    await rec.enqueue({"name": "low-old"}, priority=0, run_at=now - timedelta(seconds=30))
    await rec.enqueue({"name": "high-new"}, priority=10, run_at=now - timedelta(seconds=1))
    await rec.enqueue({"name": "high-old"}, priority=10, run_at=now - timedelta(seconds=20))
    await rec.enqueue({"name": "low-new"}, priority=0, run_at=now - timedelta(seconds=2))
    await rec.enqueue({"name": "future"}, priority=99, delay=0.6)
    async with running(Worker(queue, concurrency=1, batch_size=1, poll_interval=0.05)):
        await wait_for(lambda: len(order) == 5, what="all five ran")
    assert order == ["high-old", "high-new", "low-old", "low-new", "future"]


async def test_batch_claims_at_most_free_slots(queue: Queue) -> None:
    gate = anyio.Event()
    active: list[int] = []
    peak = [0]

    @queue.task(name="hold")
    async def hold(job: Job) -> None:
        active.append(job.id)
        peak[0] = max(peak[0], len(active))
        await gate.wait()
        active.remove(job.id)

    await queue.enqueue_many("hold", [{} for _ in range(30)])
    async with running(Worker(queue, concurrency=4, batch_size=10, poll_interval=0.05)):
        await wait_for(lambda: len(active) == 4, what="four running")
        assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'running'") == 4
        gate.set()
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 0 FROM {s}.jobs"), what="drain")
    assert peak[0] == 4


async def test_handlers_never_outnumber_concurrency_while_jobs_flow(queue: Queue) -> None:
    # Claims of the fetcher and claims folded into flushes overlap while jobs flow; each must
    # count the other's slots (a fold during a fetcher's claim ran 8 handlers at concurrency 6).
    active: list[int] = []
    peak = [0]
    ran: list[int] = []

    @queue.task(name="brief")
    async def brief(job: Job) -> None:
        active.append(job.id)
        peak[0] = max(peak[0], len(active))
        await asyncio.sleep(0.0005 * (job.id % 3))
        active.remove(job.id)
        ran.append(job.id)

    await queue.enqueue_many("brief", [{} for _ in range(3000)])
    async with running(Worker(queue, concurrency=6, batch_size=3, poll_interval=0.05)):
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 0 FROM {s}.jobs"),
                       timeout=60, what="drain")
    assert len(ran) == len(set(ran)) == 3000
    assert peak[0] <= 6


async def test_heartbeat_keeps_a_long_job_alive(queue: Queue) -> None:
    runs: list[int] = []

    @queue.task(name="long")
    async def long(job: Job) -> None:
        runs.append(job.attempt)
        await anyio.sleep(3.6)  # three times the lease

    job_id = await long.enqueue({})
    w = Worker(queue, lease=1.2, poll_interval=0.1, reap_interval=0.2)
    async with running(w):
        await wait_for(lambda: all_done(queue, [job_id]), timeout=20, what="long job done")
    assert runs == [1]
    assert w.heartbeat is not None and w.heartbeat.beats >= 5
    assert w.reaper is not None and w.reaper.reaped == 0


async def test_stale_worker_completion_is_refused_by_fencing(queue: Queue) -> None:
    job_id = await queue.enqueue("t", {})

    def fetcher(worker_id: str) -> Fetcher:
        return Fetcher(queue.database, worker_id, ["default"], batch_size=1, concurrency=1,
                       poll_interval=1, free_slots=lambda: 1, dispatch=lambda j: None)

    (a_job,) = await fetcher("worker-a").claim(1)
    # worker-a goes silent: its lease runs out and the reaper requeues the job...
    await execute(queue, "UPDATE {s}.jobs SET locked_at = now() - interval '1 hour'")
    assert await Reaper(queue.database, lease=30, interval=1).reap() == 1
    info = await queue.get(job_id)
    assert info is not None and info.status == "queued" and info.last_error is not None
    assert "lease expired, worker worker-a stopped heartbeating" in info.last_error
    # ...worker-b claims attempt 2...
    (b_job,) = await fetcher("worker-b").claim(1)
    assert b_job.attempt == 2
    # ...and worker-a's late completion of attempt 1 is refused, not written.
    late = Completer(queue.database, "worker-a", max_batch=10)
    late.add(Outcome(a_job.id, a_job.attempt, "done"))
    await late.flush()
    assert late.refused == 1
    assert await status_of(queue, job_id) == "running"
    assert await fetchval(queue, "SELECT locked_by FROM {s}.jobs WHERE id = %s",
                          job_id) == "worker-b"
    b = Completer(queue.database, "worker-b", max_batch=10)
    b.add(Outcome(b_job.id, b_job.attempt, "done"))
    await b.flush()
    assert b.refused == 0 and await status_of(queue, job_id) == "done"


async def test_a_done_flush_is_fenced_on_the_attempt_and_locks_rows_in_id_order(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush of done outcomes alone (DONE_OUTCOMES) has no `locked` CTE: its DELETE locks
    the rows and is fenced on the attempt itself. A late outcome of attempt 1 from the worker
    that now runs attempt 2 is refused beside two accepted ones. On the plan workers run
    (generic, no sequential or bitmap scan) that DELETE reads the primary key on `= ANY(...)`,
    which btree walks in sorted order: rows are locked in id order, as the heartbeat and the
    other flushes lock theirs, and the attempt is a hashed subplan, not a join read once a
    row. Without those settings (a pooled connection) done outcomes take the flush that locks
    its rows first."""
    ids = await queue.enqueue_many("t", [{}, {}, {}])
    fetcher = claimer(queue, ["default"], 3)
    first = {j.id: j for j in await fetcher.claim(3)}
    await execute(queue, "UPDATE {s}.jobs SET locked_at = now() - interval '1 hour'"
                  " WHERE id = %s", ids[0])
    assert await Reaper(queue.database, lease=30, interval=1).reap() == 1
    (again,) = await fetcher.claim(1)
    assert (again.id, again.attempt) == (ids[0], 2)
    shapes: list[tuple[int | None, int]] = []  # (partition, outcomes) of each statement
    sql_of = queue.database.sql_of

    def recording(gen: int | None, outcomes: int = ANY_OUTCOMES) -> Any:
        shapes.append((gen, outcomes))
        return sql_of(gen, outcomes)

    monkeypatch.setattr(queue.database, "sql_of", recording)
    # With the fetcher, as a worker's: it knows each job's partition (jobs_0), and the flush
    # names it.
    completer = Completer(queue.database, "w", max_batch=10, fetcher=fetcher)
    outcomes = [Outcome(i, first[i].attempt, "done") for i in reversed(ids)]
    assert outcomes_of(outcomes) == DONE_OUTCOMES
    for o in outcomes:
        completer.add(o)
    async with anyio.create_task_group() as tg:  # through a lane, as a running worker does
        tg.start_soon(completer.run)
        await wait_for(lambda: completer.backlog == 0, what="the flush")
        tg.cancel_scope.cancel()
    assert completer.refused == 1 and shapes[0] == (0, DONE_OUTCOMES), shapes
    assert [await status_of(queue, i) for i in ids] == ["running", "done", "done"]
    assert (await queue.stats())["default"]["done"] == 2
    # A flush on a pooled connection, where the worker's plan settings are not in force,
    # locks its rows first (and is still the flush of done outcomes alone: no UPDATE).
    completer.add(Outcome(again.id, again.attempt, "done"))
    await completer.flush()
    assert shapes[-1][1] == LOCKED_DONE_OUTCOMES, shapes
    locked_first = sql_of(0, LOCKED_DONE_OUTCOMES).job_set_outcome_if_running_many
    assert " locked AS MATERIALIZED (" in locked_first.as_string(None)
    assert " updated AS (" not in locked_first.as_string(None)
    assert await status_of(queue, ids[0]) == "done"
    monkeypatch.undo()

    st = queue.database.sql_of(0, DONE_OUTCOMES)
    text = st.job_set_outcome_if_running_many_then_claim_one_queue.as_string(None)
    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", text):
        if name not in names:
            names.append(name)
        text = text.replace(f"%({name})s", f"${names.index(name) + 1}")
    values = {"outcomes": "[]", "worker": "w", "done": "d", "queue": "default", "limit": 10}
    async with queue.connection() as conn:
        await conn.execute(st.session_worker_plans)
        await conn.execute(sql.SQL("PREPARE done_flush AS {}").format(sql.SQL(text)))
        cur = await conn.execute(sql.SQL("EXPLAIN (COSTS OFF) EXECUTE done_flush({})").format(
            sql.SQL(", ").join(sql.Literal(values[n]) for n in names)))
        plan = "\n".join(r[0] for r in await cur.fetchall())
        await conn.execute("DEALLOCATE done_flush")
    delete = plan[plan.index("Delete on jobs_0 j"):plan.index("CTE archived")]
    assert "Index Scan using jobs_0_pkey on jobs_0 j" in delete, plan
    assert "hashed SubPlan" in delete, plan
    assert not any(n in delete for n in ("Join", "Nested Loop", "Sort", "LockRows")), plan
    assert "CTE locked" not in plan, plan
    # Through jobs (no partition named, as after a switch) the DELETE would read one partition
    # after the other, ids out of order across them: that flush locks its rows first.
    everywhere = queue.database.sql_of(None, DONE_OUTCOMES).job_set_outcome_if_running_many
    assert " locked AS MATERIALIZED (" in everywhere.as_string(None)


async def test_the_fetcher_leaves_a_claim_to_a_flush_about_to_be_written(queue: Queue) -> None:
    """While claims come back full, the slots that finished handlers free are claimed by the
    flush of their outcomes once it is due, in its one statement: the fetcher waits for it.
    Not while every lane is busy (one on a lock, or backing off, may not flush for seconds),
    not after a fold declined (outcomes of another generation), nor after a lost claim."""
    fetcher = Fetcher(queue.database, "w", ["default"], batch_size=2, concurrency=4,
                      poll_interval=1, free_slots=lambda: 4, dispatch=lambda _: None)
    completer = Completer(queue.database, "w", max_batch=2, fetcher=fetcher,
                          flush_interval=60)
    fetcher._folding = completer.folds_soon
    fetcher.gen = 0
    fetcher.found_less = False
    completer.add(Outcome(1, 1, "done"))
    completer._idle_lanes = 1
    assert not fetcher._defer()  # one outcome of two, its flush_interval not passed
    completer.add(Outcome(2, 1, "done"))
    assert fetcher._defer()  # a full batch, a lane free to take it
    completer._idle_lanes = 0
    assert not fetcher._defer()  # every lane busy: claim now
    completer._idle_lanes = 1
    fetcher.found_less = True
    assert not fetcher._defer()  # the queue ran short: claims are not coming back full
    fetcher.found_less = False
    assert fetcher.fold(gen=1) is None  # outcomes of the other generation: no claim folded
    assert not fetcher._defer()
    folded = fetcher.fold(gen=0)
    assert folded is not None and fetcher._defer()
    fetcher.folded_failed(folded)  # its reply lost: released first, by the fetcher
    assert not fetcher._defer()
    # Due by time: the first outcome waited its flush_interval.
    fetcher._suspect = False
    late = Completer(queue.database, "w", max_batch=10, flush_interval=0.0)
    late.add(Outcome(3, 1, "done"))
    late._idle_lanes = 1
    assert late.folds_soon()


async def test_a_flush_claims_the_next_jobs_in_the_same_statement(queue: Queue) -> None:
    first = await queue.enqueue("t", {})
    rest = await queue.enqueue_many("t", [{} for _ in range(5)])
    dispatched: list[Job] = []
    fetcher = Fetcher(queue.database, "w", ["default"], batch_size=3, concurrency=4,
                      poll_interval=1, free_slots=lambda: 4 - len(dispatched),
                      dispatch=dispatched.append)
    (job,) = await fetcher.claim(1)
    assert job.id == first
    completer = Completer(queue.database, "w", max_batch=10, fetcher=fetcher)
    completer.add(Outcome(job.id, job.attempt, "done"))
    completer.add(Outcome(rest[4], 1, "done"))  # not held by "w": refused, not written
    async with anyio.create_task_group() as tg:
        tg.start_soon(completer.run)
        await wait_for(lambda: completer.backlog == 0, what="the flush")
        tg.cancel_scope.cancel()
    assert [j.id for j in dispatched] == rest[:3]  # the free slots, at most a batch
    assert completer.refused == 1
    assert await status_of(queue, first) == "done"
    assert await status_of(queue, rest[4]) == "queued"
    # One statement, one transaction: the claim's locked_at is the completion's finished_at.
    finished_at = await fetchval(queue, "SELECT finished_at FROM {s}.jobs_history WHERE id = %s",
                                 first)
    locked = await fetchval(queue, "SELECT array_agg(DISTINCT locked_at) FROM {s}.jobs"
                            " WHERE status = 'running'")
    assert locked == [finished_at]
    # Nothing free: the next flush only writes.
    completer.add(Outcome(dispatched[0].id, dispatched[0].attempt, "done"))
    dispatched.append(dispatched[0])  # four slots taken
    async with anyio.create_task_group() as tg:
        tg.start_soon(completer.run)
        await wait_for(lambda: completer.backlog == 0, what="the second flush")
        tg.cancel_scope.cancel()
    assert len(dispatched) == 4 and await status_of(queue, rest[0]) == "done"
    assert await status_of(queue, rest[3]) == "queued"


@pytest.mark.parametrize(("kinds", "shape"), [
    (["done", "done"], DONE_OUTCOMES), (["done", "failed"], PLAIN_OUTCOMES),
    (["done", "retry"], ANY_OUTCOMES), (["done", "result"], ANY_OUTCOMES)])
async def test_each_shape_of_flush_writes_its_outcomes_and_counts_them(
        queue: Queue, pg_dsn: str, kinds: list[str], shape: int) -> None:
    """A flush is one of three statements by what its outcomes are (_db/sql/claim.py): the
    one for done outcomes alone leaves out the update of rows that stay, and the
    notification of those queued again."""
    ids = await queue.enqueue_many("t", [{}, {}, {}])
    listener = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queue.database.channel)))
    held: list[Job] = []
    fetcher = Fetcher(queue.database, "w", ["default"], batch_size=2, concurrency=4,
                      poll_interval=1, free_slots=lambda: 4 - len(held), dispatch=held.append)
    jobs = await fetcher.claim(2)
    outcomes = [Outcome(j.id, j.attempt, "done" if k == "result" else k,
                        result="42" if k == "result" else None,
                        error="boom" if k in ("failed", "retry") else None)
                for j, k in zip(jobs, kinds, strict=True)]
    assert outcomes_of(outcomes) == shape
    completer = Completer(queue.database, "w", max_batch=10, fetcher=fetcher)
    for o in outcomes:
        completer.add(o)
    async with anyio.create_task_group() as tg:  # the flush folds a claim of the third job
        tg.start_soon(completer.run)
        await wait_for(lambda: completer.backlog == 0, what="the flush")
        tg.cancel_scope.cancel()
    assert completer.refused == 0 and [j.id for j in held] == [ids[2]]
    want = {"done": "done", "failed": "failed", "retry": "queued", "result": "done"}
    assert [await status_of(queue, j.id) for j in jobs] == [want[k] for k in kinds]
    assert (await queue.get(jobs[1].id)).result == (  # type: ignore[union-attr]
        42 if kinds[1] == "result" else None)
    assert await status_of(queue, ids[2]) == "running"
    done = sum(1 for k in kinds if k in ("done", "result"))
    assert (await queue.stats())["default"]["done"] == done
    heard = []  # the retried job's lane, announced by the flush
    async for n in listener.notifies(timeout=0.5 if "retry" in kinds else 0.2):
        heard.append(n.payload)
    await listener.close()
    assert bool(heard) == ("retry" in kinds), heard


@pytest.mark.parametrize("queues", [["default"], ["default", "other"]])
@pytest.mark.parametrize("analyzed_small", [False, True], ids=["never-analyzed", "analyzed-small"])
async def test_claims_run_on_a_generic_plan_that_reads_the_claim_index(
        queue: Queue, queues: list[str], analyzed_small: bool) -> None:
    fetcher = claimer(queue, queues, 10)
    queue_arg = psycopg.sql.Literal(queues[0] if len(queues) == 1 else queues)

    async def reused_plan(claims: int) -> str:
        """The plan every claim of the fetcher's connection reuses, blind to the queue and the
        limit, after `claims` claims on it."""
        async with fetcher._own.connection() as conn:
            cur = await conn.execute(
                "SELECT name, generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE 'UPDATE%'")
            ((name, generic, custom),) = await cur.fetchall()
            assert custom == 0 and generic >= claims  # EXPLAIN EXECUTE counts one too
            cur = await conn.execute(
                psycopg.sql.SQL("EXPLAIN EXECUTE {}('w', {}, 10)").format(
                    psycopg.sql.Identifier(name), queue_arg))
            return "\n".join(r[0] for r in await cur.fetchall())

    async with fetcher._own:
        # Planned on a table statistics call empty or tiny, kept while a backlog arrives
        # (nothing analyzed it since). On a tiny table a sequential scan is cheapest, and a
        # plan that kept one scanned the whole backlog every claim...
        if analyzed_small:
            await queue.enqueue_many("t", [{} for _ in range(20)])
            await execute(queue, "ANALYZE {s}.jobs")
            assert len(await fetcher.claim(10)) == 10
        else:
            assert await fetcher.claim(10) == []
        await queue.enqueue_many("t", [{} for _ in range(5000)])
        assert len(await fetcher.claim(10)) == 10
        plan = await reused_plan(2)
        assert "jobs_0_dequeue_idx" in plan and "Seq Scan" not in plan, plan
        # ...and planned again once statistics know the backlog. It must still read the claim
        # index, not scan the table: IN (...) made it a hash join over a Seq Scan, and
        # queue = ANY(...) a sort of every queued row.
        await execute(queue, "ANALYZE {s}.jobs")
        assert len(await fetcher.claim(10)) == 10
        plan = await reused_plan(3)
        assert "jobs_0_dequeue_idx" in plan and "Seq Scan" not in plan, plan
    completer = Completer(queue.database, "w", max_batch=10, fetcher=fetcher)
    for held in completer._lanes:
        async with held, held.connection() as conn:
            cur = await conn.execute(
                "SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan'),"
                " current_setting('enable_bitmapscan')")
            assert await cur.fetchone() == ("force_generic_plan", "off", "off")


@pytest.mark.parametrize("queues", [["default"], ["default", "other"]])
async def test_claims_do_not_walk_jobs_that_are_not_due_yet(
        queue: Queue, queues: list[str]) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    # Not due: a higher priority holding only delayed jobs, and delayed jobs behind the due
    # ones of the lower priority.
    await queue.enqueue_many("t", [{} for _ in range(3000)], priority=10, run_at=later)
    await queue.enqueue_many("t", [{} for _ in range(3000)], priority=0, run_at=later)
    due = await queue.enqueue_many("t", [{} for _ in range(5)], priority=0)
    await execute(queue, "ANALYZE {s}.jobs")
    async with queue.connection() as conn:
        claim = await explain_claim(conn, queue.database.sql_of(0), "default", limit=10)
    # A few index descents, not the 6,000 delayed entries (about 40 leaf pages).
    assert claim["blocks"] < 20, claim
    fetcher = claimer(queue, queues, 10)
    assert sorted(j.id for j in await fetcher.claim(10)) == due
    assert await fetcher.claim(10) == []


async def test_a_claim_over_several_queues_takes_the_first_due_jobs_of_all_of_them(
        queue: Queue) -> None:
    now = datetime.now(UTC)
    ids = {}
    for name, q, priority, age in [("a-low-old", "a", 0, 50), ("b-high", "b", 5, 1),
                                   ("a-high", "a", 5, 2), ("b-low-older", "b", 0, 60),
                                   ("c-top", "c", 9, 90), ("b-low-new", "b", 0, 3)]:
        ids[name] = await queue.enqueue("t", {}, queue=q, priority=priority,
                                        run_at=now - timedelta(seconds=age))
    names = {v: k for k, v in ids.items()}
    fetcher = claimer(queue, ["a", "b"], 3)
    first = await fetcher.claim(3)
    assert [names[j.id] for j in first] == ["a-high", "b-high", "b-low-older"]
    # Rows a queue offered past the limit were locked only while that claim ran.
    second = await fetcher.claim(3)
    assert [names[j.id] for j in second] == ["a-low-old", "b-low-new"]
    assert await fetcher.claim(3) == []
    assert await status_of(queue, ids["c-top"]) == "queued"


async def test_notification_wakes_idle_worker_long_before_poll(queue: Queue) -> None:
    started: list[float] = []

    @queue.task(name="ping")
    async def ping(job: Job) -> None:
        started.append(time.monotonic())

    w = Worker(queue, poll_interval=30)
    async with running(w):
        assert w.listener is not None
        await wait_for(lambda: w.listener is not None and w.listener.connected.is_set(),
                       what="LISTEN connected")
        await asyncio.sleep(0.2)  # let the fetcher's first (empty) claim finish and go idle
        for _ in range(3):
            t0 = time.monotonic()
            before = len(started)
            await ping.enqueue({})
            await wait_for(lambda b=before: len(started) > b, timeout=5, what="wake-up")
            assert started[-1] - t0 < 1.0


async def test_listen_connection_killed_is_reestablished(queue: Queue, pg_dsn: str) -> None:
    started: list[float] = []

    @queue.task(name="ping")
    async def ping(job: Job) -> None:
        started.append(time.monotonic())

    w = Worker(queue, poll_interval=30)
    async with running(w):
        assert w.listener is not None
        await wait_for(lambda: w.listener is not None and w.listener.backend_pid is not None,
                       what="LISTEN connected")
        old_pid = w.listener.backend_pid
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        await wait_for(lambda: w.listener is not None and w.listener.connects >= 2
                       and w.listener.backend_pid not in (None, old_pid),
                       timeout=10, what="LISTEN reconnected")
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await ping.enqueue({})
        await wait_for(lambda: len(started) == 1, timeout=5, what="wake-up after reconnect")
        assert started[0] - t0 < 1.0


async def test_stop_releases_running_jobs_to_queued(queue: Queue) -> None:
    @queue.task(name="forever")
    async def forever(job: Job) -> None:
        await anyio.sleep(3600)

    ids = await queue.enqueue_many("forever", [{} for _ in range(3)])
    w = Worker(queue, shutdown_timeout=0.3, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: len(w.running_jobs) == 3, what="three running")
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'running'") == 0
    for i in ids:
        info = await queue.get(i)
        assert info is not None and info.status == "queued" and info.attempts == 1
        assert info.last_error is not None and "interrupted by worker shutdown" in info.last_error


async def test_worker_refuses_bad_settings(queue: Queue) -> None:
    for kwargs in ({"concurrency": 0}, {"batch_size": -1}, {"lease": 0},
                   {"poll_interval": -1}, {"queues": ()}, {"shutdown_timeout": -1},
                   {"shutdown_timeout": float("nan")}, {"shutdown_timeout": True},
                   {"shutdown_timeout": 10**400}, {"lease": 10**400}):
        try:
            Worker(queue, **kwargs)  # type: ignore[arg-type]
        except asyncjobq.ConfigurationError as e:
            (key,) = kwargs
            assert "use" in str(e) and str(e).startswith(key), e  # names what was wrong
        else:
            raise AssertionError(f"Worker accepted {kwargs}")
    # No bound on how long a shutdown waits for running handlers: stays allowed.
    assert Worker(queue, shutdown_timeout=float("inf")).shutdown_timeout == float("inf")


async def test_default_batch_grows_with_concurrency(queue: Queue) -> None:
    assert Worker(queue).batch_size == 10  # concurrency 20, batch 10
    assert Worker(queue, concurrency=5).batch_size == 10
    assert Worker(queue, concurrency=50).batch_size == 25
    assert Worker(queue, concurrency=200).batch_size == 100
    assert Worker(queue, concurrency=1000).batch_size == 100
    assert Worker(queue, concurrency=200, batch_size=7).batch_size == 7


async def test_worker_needs_installed_schema(pg_dsn: str, schema: str) -> None:
    async with Queue(pg_dsn, schema=schema) as q:
        try:
            await Worker(q).run()
        except asyncjobq.SchemaNotInstalledError as e:
            assert "asyncjobq install" in str(e)
        else:
            raise AssertionError("worker ran without a schema")


async def test_only_one_reaper_works_at_a_time(queue: Queue, pg_dsn: str) -> None:
    await queue.enqueue_many("t", [{} for _ in range(3)])
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                  " locked_by = 'gone', locked_at = now() - interval '1 hour'")
    reaper = Reaper(queue.database, lease=30, interval=1)
    # Another worker's reaper is mid-turn: it holds the advisory lock in its transaction.
    async with await psycopg.AsyncConnection.connect(pg_dsn) as other:
        async with other.transaction():
            cur = await other.execute(queue.sql.reaper_try_lock)
            assert (await cur.fetchone()) == (True,)
            assert await reaper.reap() == 0
    assert await reaper.reap() == 3
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'queued'") == 3
    # Attempts spent: the reaper fails the job instead of requeueing it.
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = max_attempts,"
                  " locked_by = 'gone', locked_at = now() - interval '1 hour'")
    assert await reaper.reap() == 3
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'failed'") == 3


async def test_garbage_retry_delays_fail_the_attempt_not_the_worker(queue: Queue) -> None:
    # A NaN or an infinite delay in a flush fails the statement, with every outcome batched
    # with it, each time the flush is tried again; the worker died of it before.
    @queue.task(name="forever", max_attempts=1)
    async def forever(job: Job) -> None:
        raise Retry(delay=float("inf"))

    def nan_backoff(attempt: int) -> float:
        return float("nan")

    def broken_backoff(attempt: int) -> float:
        raise RuntimeError("backoff bug")

    @queue.task(name="nan", max_attempts=2, backoff=nan_backoff)
    async def nan(job: Job) -> None:
        raise RuntimeError("not yet")

    @queue.task(name="broken", max_attempts=2, backoff=broken_backoff)
    async def broken(job: Job) -> None:
        raise RuntimeError("not yet")

    @queue.task(name="fine")
    async def fine(job: Job) -> None: ...

    forever_id, nan_id, broken_id = (await forever.enqueue({}), await nan.enqueue({}),
                                     await broken.enqueue({}))
    fine_ids = await queue.enqueue_many("fine", [{} for _ in range(20)])
    retried = ("SELECT count(*) = 2 FROM {s}.jobs WHERE id = ANY(%s) AND status = 'queued'"
               " AND attempts = 1 AND run_at > now() + interval '1 second'")
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: all_done(queue, [forever_id], "failed"), what="forever failed")
        await wait_for(lambda: all_done(queue, fine_ids), what="the other jobs done")
        # Retried on the default backoff (2 s and more after the first attempt).
        await wait_for(lambda: fetchval(queue, retried, [nan_id, broken_id]),
                       what="retries scheduled")
    info = await queue.get(forever_id)
    assert info is not None and info.last_error is not None
    assert "Retry(delay=inf): use a number of seconds from 0 to 10,000 years" in info.last_error


async def test_retry_due_before_poll_wakes_the_worker(queue: Queue) -> None:
    times: list[float] = []

    @queue.task(name="flaky", backoff=lambda n: 0.3)
    async def flaky(job: Job) -> None:
        times.append(time.monotonic())
        if job.attempt == 1:
            raise RuntimeError("first attempt fails")

    job_id = await flaky.enqueue({})
    async with running(Worker(queue, poll_interval=30)):
        await wait_for(lambda: all_done(queue, [job_id]), timeout=10, what="retried job done")
    assert len(times) == 2 and 0.25 < times[1] - times[0] < 3.0


async def test_delayed_job_runs_when_due_not_at_next_poll(queue: Queue) -> None:
    times: list[float] = []

    @queue.task(name="later")
    async def later(job: Job) -> None:
        times.append(time.monotonic())

    w = Worker(queue, poll_interval=30)
    async with running(w):
        await wait_for(lambda: w.listener is not None and w.listener.connected.is_set())
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await later.enqueue({}, delay=0.8)
        await wait_for(lambda: len(times) == 1, timeout=10, what="delayed job ran")
    assert 0.7 < times[0] - t0 < 3.0


async def test_worker_serves_several_queues_and_only_those(queue: Queue) -> None:
    seen: list[str] = []

    @queue.task(name="q")
    async def q(job: Job) -> None:
        seen.append(job.queue)

    for name in ("a", "b", "c"):
        await q.enqueue({}, queue=name)
    async with running(Worker(queue, queues=("a", "b"), poll_interval=0.1)):
        await wait_for(lambda: len(seen) == 2, what="a and b ran")
        await asyncio.sleep(0.3)
    assert sorted(seen) == ["a", "b"]
    assert (await queue.stats())["c"]["queued"] == 1


def test_the_fetchers_job_is_the_one_job_makes() -> None:
    """claimed_job (the fetcher's constructor, one __dict__ update) makes what Job(...)
    makes, every field set: a field added to Job and forgotten there fails here."""
    import dataclasses

    from asyncjobq.job import claimed_job

    at = datetime(2026, 1, 2, tzinfo=UTC)
    values = dict(id=7, task="t", queue="q", payload={"a": [1]}, priority=-3, attempt=2,
                  max_attempts=5, run_at=at, created_at=at - timedelta(seconds=1),
                  worker="w-1", trace_context={"traceparent": "00-x"}, control=None,
                  has_parents=True)
    fast = claimed_job(**values)  # type: ignore[arg-type]
    slow = Job(**values)  # type: ignore[arg-type]
    for f in dataclasses.fields(Job):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(Job)}
    assert fast == slow and repr(fast) == repr(slow)
    assert fast.parent_results == {} and fast.parent_results is not claimed_job(
        **values).parent_results  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.attempt = 3  # type: ignore[misc]
    assert not hasattr(Job, "__post_init__"), "claimed_job skips __init__: run it there too"


async def test_the_payload_is_read_with_the_apps_json_loader(queue: Queue) -> None:
    """The worker reads payloads as the app's psycopg reads JSON: a loader set for the whole
    process (Decimal for money) applies to job.payload too, and text outside ASCII arrives
    intact."""
    import json
    from decimal import Decimal

    from psycopg.types.json import set_json_loads

    seen: list[dict[str, object]] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        seen.append(job.payload)

    payload = {"name": "Zoë 名前 🙂", "amount": 19.99, "nested": {"k": ["ä", 1, None]}}
    await queue.enqueue("t", payload)
    set_json_loads(lambda data: json.loads(data, parse_float=Decimal))
    try:
        async with running(Worker(queue)):
            await wait_for(lambda: len(seen) == 1, 10, what="the job run")
            # Set again while the worker runs: its connections' next reads use it too.
            set_json_loads(lambda data: {"late": json.loads(data)})
            await queue.enqueue("t", {"n": 2})
            await wait_for(lambda: len(seen) == 2, 10, what="the second job run")
    finally:
        set_json_loads(json.loads)
    assert seen == [{**payload, "amount": Decimal("19.99")}, {"late": {"n": 2}}]
    assert isinstance(seen[0]["amount"], Decimal)


async def test_the_payload_is_read_with_a_jsonb_loader_the_app_registered(queue: Queue) -> None:
    """A loader class the app registers for jsonb on psycopg's global adapters is what reads
    job.payload: the worker's faster loader (_db/jsonload.py) stands aside for it. Without
    such a loader, the worker's own connections read jsonb with the faster one, which gives
    what psycopg's would, text outside ASCII included."""
    import json

    from psycopg.types.json import JsonbLoader

    from asyncjobq._db import jsonload

    class Tagged(JsonbLoader):
        def load(self, data: Any) -> Any:
            return {"tagged": json.loads(bytes(data))}

    seen: list[dict[str, object]] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        seen.append(job.payload)

    payload = {"name": "Zoë 名前 🙂", "n": [1.5, None, True, {"k": "ä"}]}
    await queue.enqueue("t", {"first": 1})
    async with running(Worker(queue)) as w:
        await wait_for(lambda: len(seen) == 1, 10, what="the first job run")
        # The worker's own connections: the faster loader, same values.
        assert w.fetcher is not None  # its first claim was made on its own connection
        own = w.fetcher._own._conn
        assert own is not None and own.adapters.get_loader(
            own.adapters.types["jsonb"].oid, psycopg.pq.Format.TEXT) is jsonload.FastJsonbLoader
    assert seen == [{"first": 1}]
    text = json.dumps(payload, ensure_ascii=False).encode()
    assert jsonload.FastJsonbLoader(3802).load(memoryview(text)) == JsonbLoader(3802).load(text)

    await queue.enqueue("t", payload)
    psycopg.adapters.register_loader("jsonb", Tagged)
    try:
        async with running(Worker(queue)):
            await wait_for(lambda: len(seen) == 2, 10, what="the second job run")
    finally:
        psycopg.adapters.register_loader("jsonb", JsonbLoader)
    assert seen[1] == {"tagged": payload}


async def test_a_fetcher_cancelled_with_a_slot_freed_claims_nothing_more(queue: Queue) -> None:
    """A worker torn down by cancelling its task group, not by stop(), while a job's end has
    just freed a slot: the fetcher's next claim would be cut off once sent and leave its rows
    running under a worker that is gone, until the lease. The fetcher looks for the cancel
    before it claims: the jobs stay queued."""
    free = [3]

    def free_slots() -> int:
        value = free[0]
        free[0] = 3  # the next look finds slots free again
        return value

    f = Fetcher(queue.database, "w", ["default"], batch_size=3, concurrency=3,
                poll_interval=30, free_slots=free_slots, dispatch=lambda job: None)
    f.gen = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(f.run)
        # Its connection is open and its lock free: the first claim came back empty, and the
        # fetcher went on to wait for a wake-up without yielding in between.
        await wait_for(lambda: f._own._conn is not None and not f._own._lock.locked(), 10,
                       what="the first claim")
        for _ in range(3):
            await queue.enqueue("t", {})
        free[0] = 0
        f.slot_freed.set()  # a job's end, then the cancel, with no await between
        f.wakeup.set()
        tg.cancel_scope.cancel()
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = 'queued'") == 3
    assert not f._suspect
