"""Results, Queue.wait / Queue.result, progress, and cancelling running jobs
(docs/guides/results.md)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from datetime import datetime
from typing import Any

import psycopg
import pytest
from conftest import execute, fetchval, running, wait_for
from psycopg import sql

from asyncjobq import (
    ConfigurationError,
    Job,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    Queue,
    QueueClosedError,
    Worker,
    _waiting,
)


def _worker(q: Queue, **kw: Any) -> Worker:
    kw.setdefault("concurrency", 20)
    return Worker(q, **kw)


async def test_a_result_is_stored_with_the_finished_job_and_waited_for(queue: Queue) -> None:
    @queue.task()
    async def render(job: Job) -> dict[str, str]:
        return {"url": f"/out/{job.id}.pdf"}

    @queue.task()
    def render_sync(job: Job) -> list[int]:
        return [job.payload["n"], 2]

    @queue.task()
    async def nothing(job: Job) -> None:
        return None

    async with running(_worker(queue)):
        a = await render.enqueue({"doc": 7})
        b = await render_sync.enqueue({"n": 1})
        c = await nothing.enqueue({})
        info = await queue.wait(a, timeout=20)
        assert (info.status, info.result) == ("done", {"url": f"/out/{a}.pdf"})
        assert await queue.result(b, timeout=20) == [1, 2]
        assert await queue.result(c, timeout=20) is None
    got = await queue.get(a)
    assert got is not None and got.result == {"url": f"/out/{a}.pdf"} and got.is_final
    # Waiting for a job already final returns at once.
    assert (await queue.wait(a, timeout=5)).result == {"url": f"/out/{a}.pdf"}


async def test_wait_refuses_unknown_ids_bad_timeouts_and_times_out(queue: Queue) -> None:
    with pytest.raises(JobNotFoundError) as e:
        await queue.wait(987654321, timeout=10)
    assert isinstance(e.value, LookupError) and "987654321" in str(e.value)

    @queue.task()
    async def later(job: Job) -> None:
        pass

    job_id = await later.enqueue({})  # no worker runs it
    with pytest.raises(TimeoutError):
        await queue.wait(job_id, timeout=0.3)
    for bad in (-1, "soon", float("nan")):
        with pytest.raises(ConfigurationError, match="timeout="):
            await queue.wait(job_id, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="job_id"):
        await queue.wait("7")  # type: ignore[arg-type]


async def test_result_raises_for_dead_lettered_and_cancelled_jobs(queue: Queue) -> None:
    @queue.task(max_attempts=2, backoff=lambda attempt: 0)
    async def boom(job: Job) -> None:
        raise RuntimeError(f"nope {job.attempt}")

    @queue.task()
    async def idle(job: Job) -> None:
        pass

    async with running(_worker(queue, queues=["default"])):
        failed = await boom.enqueue({})
        with pytest.raises(JobFailedError) as e:
            await queue.result(failed, timeout=20)
    # The retried first attempt was not final: the wait lasted through it.
    assert e.value.job.attempts == 2 and e.value.job.status == "failed"
    assert e.value.error == "attempt 2: RuntimeError: nope 2"
    cancelled = await idle.enqueue({}, delay=3600)
    assert await queue.cancel(cancelled)
    with pytest.raises(JobCancelledError) as c:
        await queue.result(cancelled, timeout=10)
    assert c.value.job.status == "cancelled"


async def test_a_result_that_cannot_be_stored_fails_the_job_and_not_the_worker(
        queue: Queue) -> None:
    big = Queue(queue.dsn, schema=queue.schema, max_result_bytes=1_000_000)
    async with big:
        @big.task()
        async def megabyte(job: Job) -> dict[str, str]:
            return {"blob": "x" * (job.payload["n"] - 11)}  # 11: {"blob":""}'s JSON

        @big.task()
        async def not_json(job: Job) -> Any:
            return {"when": datetime.now()}

        @big.task()
        async def nul(job: Job) -> str:
            return "a\x00b"

        async with running(_worker(big)):
            ok = await megabyte.enqueue({"n": 1_000_000})
            over = await megabyte.enqueue({"n": 1_000_001})
            dt = await not_json.enqueue({})
            bad = await nul.enqueue({})
            assert len((await big.result(ok, timeout=30))["blob"]) == 1_000_000 - 11
            for job_id, why in ((over, "1,000,001 bytes of JSON, over the queue's "
                                       "max_result_bytes=1,000,000"),
                                (dt, "not JSON"), (bad, "PostgreSQL cannot store")):
                with pytest.raises(JobFailedError) as e:
                    await big.result(job_id, timeout=30)
                # Dead-lettered at once: running it again would return the same value.
                assert e.value.job.attempts == 1, e.value.job
                assert why in (e.value.error or ""), e.value.error
            # The worker goes on.
            assert len((await big.result(await megabyte.enqueue({"n": 100}), timeout=30))
                       ["blob"]) == 89
    with pytest.raises(ConfigurationError, match="max_result_bytes"):
        Queue(queue.dsn, schema=queue.schema, max_result_bytes=-1)


async def test_a_lost_notification_delays_a_wait_by_one_recheck(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waiting, "RECHECK", 0.5)

    @queue.task()
    async def t(job: Job) -> None:
        pass

    job_id = await t.enqueue({})
    waiting = asyncio.create_task(queue.wait(job_id, timeout=30))
    await wait_for(lambda: fetchval(queue, "SELECT waited FROM {s}.jobs WHERE id = %s",
                                    job_id), what="the wait's mark")
    # Dead-lettered by hand: a statement that sends no notification.
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id = %s", job_id)
    started = time.monotonic()
    info = await waiting
    assert info.status == "failed"
    assert time.monotonic() - started < 5


async def test_a_dropped_listening_connection_is_replaced_and_the_wait_returns(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waiting, "RECHECK", 3600.0)  # only the reconnection can find it

    @queue.task()
    async def t(job: Job) -> str:
        return "ok"

    job_id = await t.enqueue({})
    waiting = asyncio.create_task(queue.wait(job_id, timeout=60))
    await wait_for(lambda: fetchval(queue, "SELECT waited FROM {s}.jobs WHERE id = %s",
                                    job_id), what="the wait's mark")
    waiter = queue._waiter
    assert waiter is not None and waiter.connects == 1
    await execute(queue, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE application_name = 'asyncjobq-wait'"
                         " AND datname = current_database()")
    async with running(_worker(queue)):
        assert (await waiting).result == "ok"
    assert waiter.connects >= 2


async def test_ten_thousand_waits_share_one_listening_connection(queue: Queue) -> None:
    @queue.task()
    async def t(job: Job) -> int:
        return int(job.payload["i"])

    ids = await queue.enqueue_many(t, [{"i": i} for i in range(10_000)])
    waits = [asyncio.create_task(queue.wait(i, timeout=120)) for i in ids]
    await asyncio.sleep(0)
    waiter = queue._waiter
    assert waiter is not None
    await wait_for(lambda: waiter.reads > 0, what="the waits' first read")
    listening = await fetchval(queue, "SELECT count(*) FROM pg_stat_activity"
                                      " WHERE application_name = 'asyncjobq-wait'"
                                      " AND datname = current_database()")
    assert listening == 1
    async with running(_worker(queue, concurrency=100, batch_size=50)):
        infos = await asyncio.gather(*waits)
    assert [i.result for i in infos] == list(range(10_000))
    # Read in batches, not one statement per wait.
    assert waiter.reads < 2_000, waiter.reads


async def test_cancelling_a_running_async_handler(queue: Queue) -> None:
    seen: list[str] = []
    calls = 0

    @queue.task()
    async def export(job: Job) -> None:
        nonlocal calls
        calls += 1
        await job.set_progress({"rows": 10})
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async with running(_worker(queue)) as w:
        job_id = await export.enqueue({})
        await wait_for(lambda: bool(w.running_jobs), what="the handler to start")
        started = time.monotonic()
        assert await queue.cancel(job_id)
        info = await queue.wait(job_id, timeout=20)
        took = time.monotonic() - started
    assert info.status == "cancelled" and seen == ["cancelled"] and calls == 1
    assert info.attempts == 1 and "cancelled while running" in (info.last_error or "")
    assert took < 5, took
    # Finished: nothing to cancel.
    assert not await queue.cancel(job_id)
    assert not await queue.cancel(123456789)


async def test_cancelling_a_running_sync_handler(queue: Queue) -> None:
    stopped = threading.Event()

    @queue.task()
    def crunch(job: Job) -> str:
        for _ in range(6000):
            if job.cancel_requested:
                stopped.set()
                return "stopped early"
            time.sleep(0.01)
        return "ran to the end"

    async with running(_worker(queue)) as w:
        job_id = await crunch.enqueue({})
        await wait_for(lambda: bool(w.running_jobs), what="the handler to start")
        assert await queue.cancel(job_id)
        info = await queue.wait(job_id, timeout=30)
    assert stopped.is_set()
    assert info.status == "cancelled" and info.result is None


async def test_the_heartbeat_carries_a_cancel_when_no_notification_does(queue: Queue) -> None:
    @queue.task()
    async def slow(job: Job) -> None:
        await asyncio.sleep(60)

    # listen=False: no listening connection, so no cancel notification is heard.
    async with running(_worker(queue, listen=False, lease=3, poll_interval=0.2)) as w:
        job_id = await slow.enqueue({})
        await wait_for(lambda: bool(w.running_jobs), what="the handler to start")
        assert await queue.cancel(job_id)
        info = await queue.wait(job_id, timeout=20)
    assert info.status == "cancelled"


async def test_a_cancel_racing_a_handler_that_returns_has_one_outcome(queue: Queue) -> None:
    n = 1000
    calls: dict[int, int] = {}

    @queue.task()
    async def quick(job: Job) -> dict[str, int]:
        calls[job.id] = calls.get(job.id, 0) + 1
        await asyncio.sleep(random.random() * 0.004)
        return {"id": job.id}

    ids = await queue.enqueue_many(quick, [{} for _ in range(n)])
    asked = 0

    async def cancel_soon(job_id: int) -> None:
        nonlocal asked
        await asyncio.sleep(random.random() * 0.5)
        asked += await queue.cancel(job_id)

    async with running(_worker(queue, concurrency=50)):
        await asyncio.gather(*(cancel_soon(i) for i in ids))
        infos = await asyncio.gather(*(queue.wait(i, timeout=60) for i in ids))
    by_status: dict[str, int] = {}
    for info in infos:
        by_status[info.status] = by_status.get(info.status, 0) + 1
        if info.status == "done":
            assert info.result == {"id": info.id}
        else:
            assert info.status == "cancelled" and info.result is None, info
    assert set(by_status) <= {"done", "cancelled"}, by_status
    assert max(calls.values()) == 1  # no rerun
    rows = await fetchval(queue, "SELECT count(*) FROM {s}.jobs_history")
    live = await fetchval(queue, "SELECT count(*) FROM {s}.jobs")
    assert (rows, live) == (n, 0)  # one outcome each, written once
    counted = await fetchval(queue, "SELECT sum(n) FROM {s}.history_counts")
    assert counted == n
    assert by_status.get("cancelled", 0) > 0 and by_status.get("done", 0) > 0, by_status


async def test_a_cancel_for_a_job_whose_worker_died_takes_effect_when_it_is_reaped(
        queue: Queue) -> None:
    calls = 0

    @queue.task()
    async def t(job: Job) -> None:
        nonlocal calls
        calls += 1

    job_id = await t.enqueue({})
    # Claimed by a worker that then died: running, its lock a minute old.
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                         " locked_by = 'dead-worker', locked_at = now() - interval '1 minute'"
                         " WHERE id = %s", job_id)
    assert await queue.cancel(job_id)
    async with running(_worker(queue, lease=5, reap_interval=0.2)):
        info = await queue.wait(job_id, timeout=30)
    assert info.status == "cancelled" and calls == 0
    assert "cancelled, as asked" in (info.last_error or "")


async def test_progress_is_coalesced_and_shown(queue: Queue) -> None:
    release = asyncio.Event()

    @queue.task()
    async def steps(job: Job) -> str:
        for i in range(1, 1001):
            await job.set_progress({"step": i})
        await release.wait()
        return "done"

    @queue.task(max_attempts=1)
    async def bad(job: Job) -> None:
        await job.set_progress({"when": datetime.now()})

    async with running(_worker(queue)) as w:
        job_id = await steps.enqueue({})
        await wait_for(lambda: fetchval(queue, "SELECT progress = '{{\"step\": 1000}}'"
                                               " FROM {s}.jobs WHERE id = %s", job_id),
                       what="the last progress")
        info = await queue.get(job_id)
        assert info is not None and info.progress == {"step": 1000}
        assert w._progress.writes <= 3
        release.set()
        assert await queue.result(job_id, timeout=20) == "done"
        with pytest.raises(JobFailedError, match="set_progress"):
            await queue.result(await bad.enqueue({}), timeout=20)
    done = await queue.get(job_id)
    assert done is not None and done.progress == {"step": 1000}


async def test_a_retry_written_after_a_cancel_was_asked_ends_cancelled(queue: Queue) -> None:
    """The handler failed (a retry on its way to the table) as the cancel arrived: the job is
    cancelled, not run again; a done outcome is kept."""
    retried = await queue.enqueue("t", {})
    done = await queue.enqueue("t", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                         " locked_by = 'w1', locked_at = now() WHERE id IN (%s, %s)",
                  retried, done)
    assert await queue.cancel(retried) and await queue.cancel(done)
    async with queue.connection() as conn:
        cur = await conn.execute(queue.sql.job_set_outcome_if_running_many, {
            "outcomes": json.dumps([[retried, 1, "retry", 0, "attempt 1: boom"],
                                    [done, 1, "done", 0, None, {"ok": 1}]]),
            "worker": "w1", "channel": queue.channel, "done": queue.database.done_channel})
        accepted = sorted(r[0] for r in await cur.fetchall() if r[0] is not None)
    assert accepted == sorted([retried, done])
    a, b = await queue.get(retried), await queue.get(done)
    assert a is not None and a.status == "cancelled" and "attempt 1: boom" in (a.last_error or "")
    assert b is not None and b.status == "done" and b.result == {"ok": 1}
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 0


async def test_a_cancel_committed_while_a_retry_is_being_written_ends_cancelled(
        queue: Queue, pg_dsn: str) -> None:
    """The flush's snapshot predates the cancel; its lock waits for it: the cancel is seen."""
    job_id = await queue.enqueue("t", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                         " locked_by = 'w1', locked_at = now() WHERE id = %s", job_id)
    canceller = await psycopg.AsyncConnection.connect(pg_dsn)
    try:
        await canceller.execute(sql.SQL("UPDATE {}.jobs SET cancel_requested_at = now()"
                                        " WHERE id = %s").format(sql.Identifier(queue.schema)),
                                (job_id,))

        async def flush() -> None:
            async with queue.connection() as conn:
                await conn.execute(queue.sql.job_set_outcome_if_running_many, {
                    "outcomes": json.dumps([[job_id, 1, "retry", 0, "attempt 1: boom"]]),
                    "worker": "w1", "channel": queue.channel,
                    "done": queue.database.done_channel})

        writing = asyncio.create_task(flush())
        await wait_for(lambda: fetchval(
            queue, "SELECT count(*) = 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                   " AND datname = current_database()"), what="the flush to wait")
        await canceller.commit()
        await asyncio.wait_for(writing, 20)
    finally:
        await canceller.close()
    info = await queue.get(job_id)
    assert info is not None and info.status == "cancelled", info


async def test_the_recheck_runs_while_other_waits_keep_the_waiter_busy(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waiting, "RECHECK", 0.5)
    silent = await queue.enqueue("t", {})
    waiting = asyncio.create_task(queue.wait(silent, timeout=30))
    await wait_for(lambda: fetchval(queue, "SELECT waited FROM {s}.jobs WHERE id = %s", silent),
                   what="the wait's mark")
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id = %s", silent)
    started = time.monotonic()
    busy = []
    while not waiting.done() and time.monotonic() - started < 10:
        # A new wait every 50 ms: the waiter is woken far more often than RECHECK.
        busy.append(asyncio.create_task(queue.wait(await queue.enqueue("t", {}), timeout=30)))
        await asyncio.sleep(0.05)
    assert waiting.done() and (await waiting).status == "failed"
    assert time.monotonic() - started < 5
    for b in busy:
        b.cancel()


async def test_closing_the_queue_ends_its_waits(pg_dsn: str, schema: str) -> None:
    q = Queue(pg_dsn, schema=schema)
    await q.open()
    await q.install()
    job_id = await q.enqueue("t", {})
    waiting = asyncio.create_task(q.wait(job_id))
    await wait_for(lambda: q._waiter is not None and q._waiter.reads > 0, what="the wait")
    await q.close()
    with pytest.raises(QueueClosedError, match="closed while waiting"):
        await asyncio.wait_for(waiting, 10)
    with pytest.raises(QueueClosedError, match="open it first"):
        await q.wait(job_id)


async def test_progress_that_postgresql_cannot_store_is_refused_in_the_handler() -> None:
    job = Job(id=1, task="t", queue="q", payload={}, attempt=1, max_attempts=1, priority=0,
              run_at=datetime.now(), created_at=datetime.now())
    with pytest.raises(ConfigurationError, match="cannot be stored"):
        await job.set_progress({"note": "a\x00b"})
    with pytest.raises(ConfigurationError, match="over 8192"):
        await job.set_progress("x" * 9000)
    await job.set_progress({"ok": 1})  # outside a worker: checked only
