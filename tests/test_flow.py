"""Flow control (issue 21): pausing and resuming a queue."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import psycopg
import pytest
from claims import CREATE_CLAIMS
from conftest import execute, fetchval, run_cli, running, spawn_worker, wait_for
from psycopg import sql

from asyncjobq import ConfigurationError, Job, Queue, Worker


async def _count(queue: Queue, status: str, q: str = "default") -> int:
    return int(await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE status = %s"
                              " AND queue = %s", status, q))


async def test_a_paused_queue_is_not_claimed_and_resume_wakes_the_workers(queue: Queue) -> None:
    ran: list[str] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        ran.append(job.queue)

    assert await queue.pause("emails") is True
    assert await queue.pause("emails") is False  # paused already: not an error
    assert list(await queue.paused()) == ["emails"]
    await queue.enqueue_many("t", [{}] * 3, queue="emails")
    # A long poll: only resume's notification can wake the worker in time.
    for queues in (["emails", "default"], ["emails"]):  # the many-queues and one-queue claims
        ran.clear()
        w = Worker(queue, queues=queues, poll_interval=30)
        async with running(w):
            if "default" in queues:
                # Enqueued after the paused jobs: claimed by claims that skipped them.
                await queue.enqueue("t", {})
                await wait_for(lambda: ran == ["default"], 10, what="the default job")
            else:
                fetcher = w.fetcher
                assert fetcher is not None
                got: list[int] = []
                fetcher.claim = _counting(fetcher.claim, got)  # type: ignore[method-assign]
                fetcher.wakeup.set()
                await wait_for(lambda: bool(got), 10, what="a claim")  # noqa: B023
                assert got[0] == 0
            assert await _count(queue, "queued", "emails") == 3
            if queues == ["emails"]:
                started = time.monotonic()
                assert await queue.resume("emails") is True
                await wait_for(lambda: ran == ["emails"] * 3, 10, what="the resumed jobs")
                assert time.monotonic() - started < 5, "resume waited for the poll"
    assert await queue.resume("emails") is False
    assert await queue.paused() == {}


def _counting(real: Callable[[int], Awaitable[list[Job]]], got: list[int],
              ) -> Callable[[int], Awaitable[list[Job]]]:
    async def claim(limit: int) -> list[Job]:
        jobs = await real(limit)
        got.append(len(jobs))
        return jobs

    return claim


@pytest.mark.processes
async def test_pause_under_load_stops_new_starts_when_it_returns(queue: Queue) -> None:
    starts: list[float] = []
    total = 400

    @queue.task(name="work")
    async def work(job: Job) -> None:
        starts.append(time.monotonic())
        await asyncio.sleep(0.02)

    await queue.enqueue_many("work", [{}] * total)
    w = Worker(queue, concurrency=10, poll_interval=30)
    async with running(w):
        await wait_for(lambda: len(starts) >= 50, 20, what="the drain under way")
        await queue.pause("default")
        returned = time.monotonic()
        await wait_for(lambda: not w.running_jobs, 10, what="the running jobs finished")
        late = [s - returned for s in starts if s > returned]
        assert not late or max(late) < 0.25, f"started {max(late):.3f} s after pause returned"
        held = await _count(queue, "queued")
        assert held == total - len(starts) > 0
        status = run_cli("status", "--json", "--schema", queue.schema, dsn=queue.dsn)
        assert status.returncode == 0, status.stderr
        assert list(json.loads(status.stdout)["paused"]) == ["default"]
        await queue.resume("default")
        await wait_for(lambda: len(starts) == total, 30, what="the rest after resume")


@pytest.mark.processes
async def test_pause_across_worker_processes(queue: Queue, pg_dsn: str) -> None:
    """Two worker processes under load: claims landing after pause() returned would show as
    handler starts (their claims rows, on the server's clock) well after it."""
    await execute(queue, CREATE_CLAIMS)
    await queue.enqueue_many("sleep", [{"seconds": 0.02}] * 600)
    procs = [spawn_worker(pg_dsn, queue.schema, "--concurrency", "10", "--poll-interval", "30")
             for _ in range(2)]
    try:
        await wait_for(lambda: _at_least(queue, 60), 30, what="both workers draining")
        await queue.pause("default")
        returned = await fetchval(queue, "SELECT clock_timestamp()")
        await wait_for(lambda: _none_running(queue), 20, what="running jobs finished")
        lag = await fetchval(queue, "SELECT extract(epoch FROM max(at) - %s) FROM {s}.claims"
                             " WHERE at > %s", returned, returned)
        print("\npause across 2 worker processes: " + (
            "no handler started after pause() returned" if lag is None else
            f"last handler start {float(lag) * 1000:.1f} ms after pause() returned"))
        assert lag is None or float(lag) < 0.5
        held = await _count(queue, "queued")
        assert held > 0
        await queue.resume("default")
        await wait_for(lambda: _none_queued(queue), 30, what="the rest after resume")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.communicate(timeout=30)


async def _at_least(queue: Queue, n: int) -> bool:
    return int(await fetchval(queue, "SELECT count(*) FROM {s}.claims")) >= n


async def _none_running(queue: Queue) -> bool:
    return await _count(queue, "running") == 0


async def _none_queued(queue: Queue) -> bool:
    return await _count(queue, "queued") == 0 and await _none_running(queue)


@pytest.mark.processes
def test_pause_and_resume_from_the_command_line(queue: Queue, pg_dsn: str) -> None:
    args = ("--schema", queue.schema)
    r = run_cli("pause", "emails", *args, dsn=pg_dsn)
    assert (r.returncode, r.stdout.strip()) == (0, "queue emails paused"), r.stderr
    r = run_cli("pause", "emails", *args, dsn=pg_dsn)
    assert r.stdout.strip() == "queue emails was paused already"
    r = run_cli("status", *args, dsn=pg_dsn)
    assert "paused without jobs: emails" in r.stdout, r.stdout
    r = run_cli("resume", "emails", *args, dsn=pg_dsn)
    assert (r.returncode, r.stdout.strip()) == (0, "queue emails resumed"), r.stderr
    r = run_cli("resume", "emails", *args, dsn=pg_dsn)
    assert r.stdout.strip() == "queue emails was not paused"
    r = run_cli("pause", "", *args, dsn=pg_dsn)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "queue" in r.stderr.strip().splitlines()[-1]


async def test_pause_refuses_a_bad_queue_name(queue: Queue) -> None:
    for bad in ("", None, 7):
        try:
            await queue.pause(bad)  # type: ignore[arg-type]
        except ConfigurationError as e:
            assert "queue" in str(e)
        else:
            raise AssertionError(f"pause({bad!r}) was accepted")


async def test_pause_waits_for_a_claim_that_began_before_it(queue: Queue, pg_dsn: str) -> None:
    """A claim under way when the pause commits cannot see it: pause() returns only once that
    claim has committed. Here the "claim" is a transaction that read paused_queues (as every
    claim does) and stays open, under another application name."""
    holder = await psycopg.AsyncConnection.connect(pg_dsn, application_name="not-asyncjobq")
    try:
        await holder.execute(sql.SQL("SELECT count(*) FROM {}.paused_queues").format(
            sql.Identifier(queue.schema)))
        pausing = asyncio.create_task(queue.pause("default"))
        await wait_for(lambda: _paused_row(pg_dsn, queue.schema), 10,
                       what="the pause committed")
        await asyncio.sleep(0)
        assert not pausing.done(), "pause() returned while an earlier claim was still open"
        await holder.commit()
        await asyncio.wait_for(pausing, 10)
        assert pausing.result() is True
    finally:
        await holder.close()


async def _paused_row(dsn: str, schema: str) -> bool:
    async with await psycopg.AsyncConnection.connect(dsn) as c:
        cur = await c.execute(sql.SQL("SELECT count(*) FROM {}.paused_queues").format(
            sql.Identifier(schema)))
        row = await cur.fetchone()
        return bool(row and row[0])


async def test_drain_leaves_a_paused_queue_alone(queue: Queue) -> None:
    from asyncjobq.testing import drain

    ran: list[str] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        ran.append(job.queue)

    await queue.enqueue("t", {}, queue="emails")
    await queue.enqueue("t", {})
    await queue.pause("emails")
    assert (await drain(queue))["done"] == 1 and ran == ["default"]
    await queue.resume("emails")
    assert (await drain(queue))["done"] == 1 and ran == ["default", "emails"]
