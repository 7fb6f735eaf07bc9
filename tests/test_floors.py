"""Claims from floors (src/asyncjobq/_worker/floors.py): a pinned horizon's dead entries are not
read again, and no job is hidden below a floor: not one committed late with an old run_at, not
one requeued, not one written while notifications were lost."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import execute, running, wait_for
from psycopg import sql

from asyncjobq import Job, Queue, Worker
from asyncjobq._worker import floors as floors_module
from asyncjobq._worker.floors import TOP, Floors

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _floors_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCJOBQ_CLAIM_FLOORS", "1")


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _known(f: Floors, *lanes: tuple[str, int, float, int]) -> None:
    token, _, _ = f.begin()
    f.discovered(token, [(q, p, _at(s), i) for q, p, s, i in lanes],
                 sorted({q for q, *_ in lanes}))


def _floor(f: Floors, queue: str, priority: int) -> tuple[datetime, int]:
    floor = f.floor(queue, priority)
    if floor is None:
        raise KeyError((queue, priority))
    return floor


def test_a_claim_moves_each_floor_to_the_first_queued_row_it_saw() -> None:
    f = Floors(["a"])
    assert f.unknown() == ["a"]
    _known(f, ("a", 0, 1, 1), ("a", 5, 2, 2))
    assert f.ready()
    token, _, params = f.begin()
    lanes = json.loads(params)
    assert [p for _, p, _, _ in lanes] == [5, 0]  # claim order: the highest priority first
    f.settle(token, [["a", 0, _at(9).isoformat(), 7], ["a", 5, None, None]])
    assert _floor(f, "a", 0) == (_at(9), 7)
    assert _floor(f, "a", 5) == TOP


def test_a_notification_lowers_a_floor_and_outlives_a_claim_in_flight() -> None:
    f = Floors(["a"])
    _known(f, ("a", 0, 5, 1))
    token, _, _ = f.begin()
    # Heard while the claim was in flight: its snapshot may predate the commit.
    f.lower("a", [[0, _at(3).timestamp()], [7, _at(4).timestamp()]])
    f.settle(token, [["a", 0, _at(10).isoformat(), 9]])
    assert _floor(f, "a", 0) < (_at(3), 0)
    assert _floor(f, "a", 7) < (_at(4), 0)  # a new lane, learnt from the notification
    # Heard before the next claim was sent: that claim started below it, its answer stands.
    f.lower("a", [[0, _at(1).timestamp()]])
    token, _, params = f.begin()
    assert datetime.fromisoformat(json.loads(params)[1][2]) < _at(1)
    f.settle(token, [["a", 0, _at(12).isoformat(), 11], ["a", 7, None, None]])
    assert _floor(f, "a", 0) == (_at(12), 11)
    # A notification for another worker's queue changes nothing here.
    f.lower("b", [[0, 0.0]])
    assert f.unknown() == []


def test_what_cannot_be_trusted_is_discovered_again() -> None:
    f = Floors(["a", "b"])
    _known(f, ("a", 0, 5, 1), ("b", 0, 5, 1))
    f.lower("a", None)  # a notification that did not name its lanes
    assert f.unknown() == ["a"]
    _known(f, ("a", 0, 5, 1))
    claim, _, _ = f.begin()
    discovery, _, _ = f.begin()
    f.forget()  # the LISTEN connection went down, or came back: notifications were lost
    assert f.unknown() == ["a", "b"]
    f.settle(claim, [["a", 0, _at(9).isoformat(), 3]])
    f.discovered(discovery, [("a", 0, _at(9), 3)], ["a"])
    assert f.unknown() == ["a", "b"]  # neither answer predates what was lost


def test_floors_are_walked_again_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    f = Floors(["a"])
    _known(f, ("a", 0, 5, 1))
    monkeypatch.setattr(floors_module, "REDISCOVER_EVERY", -1.0)
    assert f.unknown() == ["a"]


def _pin(dsn: str) -> psycopg.Connection[Any]:
    # A transaction that wrote, then sits idle: VACUUM removes nothing newer than it.
    conn = psycopg.connect(dsn)
    conn.execute("CREATE TEMP TABLE pin (x int)")
    conn.execute("INSERT INTO pin VALUES (1)")
    return conn


def _blocks(plan: Any) -> int:
    node = plan[0]["Plan"] if isinstance(plan, list) else plan
    total = 0
    if node.get("Index Name", "").endswith("dequeue_idx"):
        total += node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0)
    for child in node.get("Plans", []):
        total += _blocks(child)
    return total


async def _claim_blocks(queue: Queue, query: sql.Composed, params: dict[str, object]) -> int:
    async with queue.connection() as conn:
        async with conn.transaction(force_rollback=True):
            cur = await conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query, params)
            row = await cur.fetchone()
            assert row is not None
            plan = row[0]
            return _blocks(plan if not isinstance(plan, str) else json.loads(plan))


async def test_a_pinned_horizon_does_not_slow_a_claim_from_floors(queue: Queue,
                                                                  pg_dsn: str) -> None:
    done: list[int] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        done.append(job.id)

    pin = _pin(pg_dsn)
    try:
        w = Worker(queue, concurrency=20, batch_size=10, poll_interval=0.05)
        async with running(w):
            for _ in range(6):
                await queue.enqueue_many("t", [{}] * 500)
            await wait_for(lambda: len(done) == 3000, 60, what="3,000 jobs done")
            fetcher = w.fetcher
            assert fetcher is not None
            # A switch of generations meanwhile (the leader's, under this pin) leaves the
            # floors unknown until the next poll discovers them again.
            await wait_for(fetcher.floors.ready, 10, what="the floors known")
            await t.enqueue({})
            await wait_for(lambda: len(done) == 3001, 10, what="the last job done")
            # A claim reads its floors one time in PEEK_EVERY: the idle worker's next ones do.
            await wait_for(lambda: _floor(fetcher.floors, "default", 0) == TOP, 10,
                           what="the floor past the last job")
            token, _, lanes = fetcher.floors.begin()
            fetcher.floors.abandon(token)  # only its parameters are wanted
        params = {"queue": "default", "worker": "probe", "limit": 10, "lanes": lanes}
        # As the worker claims: from the current generation's partition; and one claim in
        # PEEK_EVERY also reads the next floors.
        st = queue.database.sql_of(fetcher.gen)
        from_floors = await _claim_blocks(queue, st.job_claim_one_queue_from_floors, params)
        peeking = await _claim_blocks(queue, st.job_claim_one_queue_from_floors_peek, params)
        from_start = await _claim_blocks(queue, st.job_claim_one_queue, params)
    finally:
        pin.close()
    print(f"\n3,001 jobs claimed under a pinned horizon: a claim from floors read "
          f"{from_floors} blocks of jobs_dequeue_idx ({peeking} reading the next floors), "
          f"one from each lane's start {from_start}")
    assert from_start >= 10 * max(from_floors, peeking, 1)
    assert from_floors <= 8 and peeking <= 8


async def test_a_job_committed_late_with_an_old_run_at_is_still_claimed(
        queue: Queue, pg_dsn: str) -> None:
    """Its transaction began (run_at = now()) before the jobs the worker claimed meanwhile,
    and committed after: the worker's floors had passed its run_at, its notification lowers
    them."""
    done: list[str] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        done.append(job.payload["name"])

    async with running(Worker(queue, concurrency=5)) as w:
        assert w.fetcher is not None
        await wait_for(lambda: w.fetcher is not None and w.fetcher.floors.ready(), 10,
                       what="floors known")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as slow:
            await slow.execute("SELECT 1")  # its now(), the job's run_at, is taken here
            await queue.enqueue_many("t", [{"name": f"early{i}"} for i in range(50)])
            await wait_for(lambda: len(done) == 50, 10, what="the others done")
            await t.enqueue({"name": "late"}, conn=slow)
            await slow.commit()
        await wait_for(lambda: "late" in done, 10, what="the late job run")


async def test_jobs_written_while_notifications_were_lost_are_claimed(
        queue: Queue, pg_dsn: str) -> None:
    done: list[int] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        done.append(job.id)

    async with running(Worker(queue, concurrency=5, poll_interval=0.2)) as w:
        fetcher, listener = w.fetcher, w.listener
        assert fetcher is not None and listener is not None
        await wait_for(lambda: fetcher.floors.ready(), 10, what="floors known")
        await queue.enqueue_many("t", [{}] * 20)
        await wait_for(lambda: len(done) == 20, 10, what="the first jobs done")
        connects = listener.connects
        # The listening session ends: notifications meanwhile are lost.
        await execute(queue, "SELECT pg_terminate_backend(%s)", listener.backend_pid)
        # A job put back to queued by hand (no notification): the periodic walk finds it.
        gone = done[0]
        await execute(queue, "INSERT INTO {s}.jobs (id, task, payload, queue, run_at)"
                      " OVERRIDING SYSTEM VALUE VALUES (%s, 't', '{{}}', 'default',"
                      " now() - interval '1 hour')", -gone)
        await wait_for(lambda: listener.connects > connects, 15, what="LISTEN reconnected")
        await wait_for(lambda: -gone in done, 15, what="the job written while deaf run")
        # A job put back to queued by hand, an UPDATE without a notification: it is found
        # when the lanes are walked again (every REDISCOVER_EVERY seconds).
        await execute(queue, "INSERT INTO {s}.jobs (task, payload, status, run_at)"
                      " VALUES ('t', '{{}}', 'failed', now() - interval '2 hours')")
        await wait_for(lambda: fetcher.floors.ready(), 10, what="floors known again")
        await execute(queue, "UPDATE {s}.jobs SET status = 'queued' WHERE status = 'failed'")
        every = floors_module.REDISCOVER_EVERY
        floors_module.REDISCOVER_EVERY = 0.5
        try:
            await wait_for(lambda: len(done) == 22, 10, what="the requeued job run")
        finally:
            floors_module.REDISCOVER_EVERY = every


def test_a_claim_in_flight_across_a_reconnect_cannot_raise_a_floor_again() -> None:
    f = Floors(["a"])
    _known(f, ("a", 0, 5, 1))
    stale, _, _ = f.begin()
    f.forget()
    _known(f, ("a", 0, 3, 2))  # rediscovered: a row written while deaf, below the old floor
    f.settle(stale, [["a", 0, _at(9).isoformat(), 3]])
    assert _floor(f, "a", 0) == (_at(3), 2)


def test_run_ats_out_of_range_lower_a_floor_to_the_bottom() -> None:
    f = Floors(["a"])
    _known(f, ("a", 0, 5, 1))
    f.lower("a", [[0, float("-inf")], [1, float("inf")], [2, 1e15]])
    assert _floor(f, "a", 0) == floors_module.BOTTOM


async def test_jobs_due_at_infinity_or_in_a_far_century_stop_no_claim(
        queue: Queue) -> None:
    done: list[int] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        done.append(job.id)

    async with running(Worker(queue, concurrency=5)) as w:
        assert w.fetcher is not None
        await wait_for(lambda: w.fetcher is not None and w.fetcher.floors.ready(), 10,
                       what="floors known")
        await execute(queue, "SELECT {s}.enqueue('t', '{{}}', run_at => 'infinity')")
        await execute(queue, "SELECT {s}.enqueue('t', '{{}}', run_at => '12025-01-01')")
        await queue.enqueue_many("t", [{}] * 5)
        await wait_for(lambda: len(done) == 5, 10, what="the due jobs run")
        await queue.enqueue_many("t", [{}] * 5)
        await wait_for(lambda: len(done) == 10, 10, what="the next jobs run")
        assert w.fetcher.floors.ready()


def test_a_floor_at_minus_infinity_keeps_its_id_and_goes_out_as_null() -> None:
    f = Floors(["a"])
    _known(f, ("a", 0, 5, 1))
    token, _, _ = f.begin()
    f.settle(token, [["a", 0, "-infinity", 42], ["a", 0, "0044-03-15T00:00:00+00:00 BC", 7]])
    _, _, params = f.begin()
    assert json.loads(params) == [["a", 0, None, 7]]
    token, _, _ = f.begin()
    f.settle(token, [["a", 0, "infinity", 9]])
    assert _floor(f, "a", 0)[0] == TOP[0]


async def test_unset_floors_follow_the_horizon(queue: Queue, pg_dsn: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ASYNCJOBQ_CLAIM_FLOORS unset: a worker claims from floors while a session holds the
    horizon, walks each lane from its start otherwise, and runs its jobs either way."""
    monkeypatch.delenv("ASYNCJOBQ_CLAIM_FLOORS")
    done: list[int] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        done.append(job.id)

    async with running(Worker(queue, concurrency=5)) as w:
        fetcher = w.fetcher
        assert fetcher is not None
        await queue.enqueue_many("t", [{}] * 10)
        await wait_for(lambda: len(done) == 10, 10, what="jobs run, horizon free")
        assert not fetcher.floors.enabled
        pin = _pin(pg_dsn)
        try:
            await wait_for(lambda: fetcher.floors.enabled, 10, what="floors on")
            await queue.enqueue_many("t", [{}] * 10)
            await wait_for(lambda: len(done) == 20 and fetcher.floors.ready(), 10,
                           what="jobs run from floors")
        finally:
            pin.close()
        await wait_for(lambda: not fetcher.floors.enabled, 10, what="floors off again")
        await queue.enqueue_many("t", [{}] * 10)
        await wait_for(lambda: len(done) == 30, 10, what="jobs run, horizon free again")
