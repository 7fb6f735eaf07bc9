"""Queue API: enqueue (own and caller's transaction), enqueue_many, get, stats, cancel,
retry_failed, dedup, install, connection()."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from conftest import execute, fetchval
from psycopg import sql

import asyncjobq
from asyncjobq import EnqueueRefusedError, Queue
from asyncjobq._db import migrations
from asyncjobq._db.inserter import Inserter


async def test_install_is_idempotent_and_concurrency_safe(pg_dsn: str, schema: str) -> None:
    queues = [Queue(pg_dsn, schema=schema) for _ in range(4)]
    for q in queues:
        await q.open()
    try:
        results = await asyncio.gather(*(q.install() for q in queues))
        versions = [m.version for m in migrations.available()]
        assert sorted(results) == [[], [], [], versions]  # exactly one applied them
        assert await queues[0].install() == []
        assert await fetchval(queues[0], "SELECT count(*) FROM {s}.migrations") == len(versions)
    finally:
        for q in queues:
            await q.close()


async def test_enqueue_and_get(queue: Queue) -> None:
    job_id = await queue.enqueue("send_email", {"to": "a@example.com"}, priority=5,
                                 max_attempts=7)
    info = await queue.get(job_id)
    assert info is not None
    assert (info.id, info.task, info.queue, info.status) == (job_id, "send_email", "default",
                                                             "queued")
    assert (info.priority, info.max_attempts, info.attempts) == (5, 7, 0)
    assert info.payload == {"to": "a@example.com"}
    assert info.finished_at is None and info.last_error is None
    assert await queue.get(job_id + 1000) is None


async def test_enqueue_in_committed_transaction(queue: Queue, pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction():
            job_id = await queue.enqueue("t", {"n": 1}, conn=conn)
            # Not visible outside the transaction yet.
            assert await queue.get(job_id) is None
        assert (await queue.get(job_id)) is not None


async def test_enqueue_in_rolled_back_transaction_leaves_nothing_and_wakes_nobody(
        queue: Queue, pg_dsn: str) -> None:
    listener = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queue.channel)))
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                job_id = await queue.enqueue("t", {"n": 1}, conn=conn)
                raise RuntimeError("the caller's work failed")
    assert await queue.get(job_id) is None
    assert await queue.stats() == {}
    got = [n async for n in listener.notifies(timeout=0.5)]
    assert got == []
    # And a committed one does notify, once per statement and queue, carrying the queue name.
    await queue.enqueue_many("t", [{"n": i} for i in range(50)], queue="q2")
    got = [n async for n in listener.notifies(timeout=1.0, stop_after=2)]
    assert len(got) == 1 and json.loads(got[0].payload)["queue"] == "q2"
    await listener.close()


async def test_enqueue_options(queue: Queue) -> None:
    at = (datetime.now(UTC) + timedelta(hours=1)).astimezone(timezone(timedelta(hours=-7)))
    a = await queue.get(await queue.enqueue("t", {}, run_at=at, queue="mail"))
    assert a is not None and a.queue == "mail" and abs((a.run_at - at).total_seconds()) < 0.01
    b = await queue.get(await queue.enqueue("t", {}, delay=60))
    assert b is not None and (b.run_at - datetime.now(UTC)).total_seconds() > 55
    c = await queue.get(await queue.enqueue("t", {}, delay=timedelta(seconds=30), run_at=at))
    assert c is not None and abs((c.run_at - at).total_seconds() - 30) < 0.01


async def test_task_defaults_and_task_enqueue(queue: Queue) -> None:
    @queue.task(name="mail.send", queue="mail", priority=3, max_attempts=9)
    async def send(job: asyncjobq.Job) -> None: ...

    info = await queue.get(await send.enqueue({"to": "c"}))
    assert info is not None
    assert (info.task, info.queue, info.priority, info.max_attempts) == ("mail.send", "mail", 3, 9)
    info = await queue.get(await queue.enqueue(send, {}, priority=1))
    assert info is not None and info.priority == 1 and info.queue == "mail"


async def test_enqueue_many_ten_thousand_in_one_statement(queue: Queue) -> None:
    payloads = [{"n": i} for i in range(10_000)]
    ids = await queue.enqueue_many("bulk", payloads)
    assert len(ids) == 10_000 and ids == sorted(ids) and len(set(ids)) == 10_000
    assert (await queue.stats())["default"]["queued"] == 10_000
    last = await queue.get(ids[-1])
    assert last is not None and last.payload == {"n": 9_999}
    assert await queue.enqueue_many("bulk", []) == []


async def test_dedup_key_returns_existing_live_job(queue: Queue) -> None:
    a = await queue.enqueue("t", {"v": 1}, dedup_key="user-42")
    b = await queue.enqueue("t", {"v": 2}, dedup_key="user-42")
    assert a == b
    assert (await queue.stats())["default"]["queued"] == 1
    # Concurrent duplicates collapse too.
    ids = await asyncio.gather(*(queue.enqueue("t", {}, dedup_key="k2") for _ in range(20)))
    assert len(set(ids)) == 1
    # Once the job is no longer queued/running the key is free again.
    assert await queue.cancel(a)
    c = await queue.enqueue("t", {"v": 3}, dedup_key="user-42")
    assert c != a


async def test_cancel(queue: Queue) -> None:
    job_id = await queue.enqueue("t", {})
    assert await queue.cancel(job_id) is True
    info = await queue.get(job_id)
    assert info is not None and info.status == "cancelled" and info.finished_at is not None
    assert await queue.cancel(job_id) is False
    assert await queue.cancel(123_456_789) is False
    assert (await queue.stats())["default"]["cancelled"] == 1


async def test_stats_has_all_statuses(queue: Queue) -> None:
    await queue.enqueue("t", {}, queue="a")
    await queue.enqueue("t", {}, queue="b")
    stats = await queue.stats()
    assert set(stats) == {"a", "b"}
    for counts in stats.values():
        assert set(counts) == {"queued", "running", "done", "failed", "cancelled"}


async def test_retry_failed_filters(queue: Queue) -> None:
    ids = [await queue.enqueue("t", {}, queue=q) for q in ("a", "a", "b")]
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = 3,"
                  " last_error = 'attempt 3: TimeoutError' WHERE id = %s", ids[0])
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = 3,"
                  " last_error = 'attempt 3: ValueError' WHERE id = ANY(%s)", ids[1:])
    assert await queue.retry_failed(error_like="%Timeout%") == 1
    info = await queue.get(ids[0])
    assert info is not None and info.status == "queued" and info.attempts == 0
    assert await queue.retry_failed(queue="b") == 1
    assert await queue.retry_failed(task="other") == 0
    assert await queue.retry_failed() == 1


async def test_connection_is_pooled_autocommit(queue: Queue) -> None:
    async with queue.connection() as conn:
        assert conn.autocommit
        cur = await conn.execute("SELECT 1")
        assert await cur.fetchone() == (1,)


async def test_pooled_connections_ended_by_the_server_are_replaced_on_checkout(
        pg_dsn: str, schema: str) -> None:
    # The checkout check skips the round trip for live connections; ended ones must still
    # be noticed there, not surface as an error from the caller's statement.
    # A fixed-size pool, all of it connected on open: a connection the pool opened in the
    # background could be caught by the termination mid-startup, and die after the sweep
    # below found nothing left (seen once under CI load on PostgreSQL 15).
    async with Queue(pg_dsn, schema=schema, application_name=f"ended-{schema}",
                     pool_min_size=4, pool_max_size=4) as q:
        await q.install()
        await asyncio.gather(*(q.enqueue("t", {}) for _ in range(8)))
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            ended = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database()"
                " AND application_name = %s", (q.application_name,)).fetchone()
            assert ended is not None and ended[0] >= 2
            for _ in range(200):
                left = admin.execute("SELECT count(*) FROM pg_stat_activity"
                                     " WHERE datname = current_database()"
                                     " AND application_name = %s",
                                     (q.application_name,)).fetchone()
                if left == (0,):
                    break
                await asyncio.sleep(0.02)
            assert left == (0,), "terminated backends did not exit"
        ids = await asyncio.gather(*(q.enqueue("t", {}) for _ in range(8)))
        assert len(set(ids)) == 8
        assert await fetchval(q, "SELECT count(*) FROM {s}.jobs") == 16


async def test_closed_queue_says_to_open(pg_dsn: str, schema: str) -> None:
    q = Queue(pg_dsn, schema=schema)
    with pytest.raises(asyncjobq.QueueClosedError, match="async with queue"):
        await q.enqueue("t", {})


async def test_schema_not_installed(pg_dsn: str, schema: str) -> None:
    async with Queue(pg_dsn, schema=schema) as q:
        with pytest.raises(asyncjobq.SchemaNotInstalledError, match="asyncjobq install"):
            await q.enqueue("t", {})
        with pytest.raises(asyncjobq.SchemaNotInstalledError):
            await q.stats()


async def test_enqueue_wakes_workers_only_at_commit(queue: Queue, pg_dsn: str) -> None:
    listener = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(queue.channel)))
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction():
            await queue.enqueue("t", {}, conn=conn, queue="tx")
            assert [n async for n in listener.notifies(timeout=0.3)] == []
        got = [n async for n in listener.notifies(timeout=2.0, stop_after=1)]
        assert len(got) == 1 and json.loads(got[0].payload)["queue"] == "tx"
    await listener.close()


async def test_sql_enqueue_function_for_other_languages(queue: Queue) -> None:
    job_id = await fetchval(queue, "SELECT {s}.enqueue('from_sql', '{{\"k\": 1}}', 'q')")
    info = await queue.get(int(job_id))
    assert info is not None and info.task == "from_sql" and info.payload == {"k": 1}
    again = await fetchval(queue, "SELECT {s}.enqueue('x', dedup_key => 'd1')")
    assert await fetchval(queue, "SELECT {s}.enqueue('x', dedup_key => 'd1')") == again


async def test_bad_payloads_are_refused_before_any_io(pg_dsn: str, schema: str) -> None:
    q = Queue(pg_dsn, schema=schema)  # never opened: an error here proves no I/O was needed
    for bad in ([1, 2], "text", {"when": datetime.now(UTC)}, {"x": float("nan")}, {"s": {1, 2}}):
        with pytest.raises(asyncjobq.InvalidPayloadError):
            await q.enqueue("t", bad)  # type: ignore[arg-type]
    with pytest.raises(asyncjobq.InvalidPayloadError, match=r"payloads\[1\]"):
        await q.enqueue_many("t", [{}, [1]])  # type: ignore[list-item]
    for kwargs in ({"priority": "high"}, {"max_attempts": 0}, {"delay": -1},
                   {"delay": 1e13}, {"run_at": datetime.now()}, {"queue": ""}, {"dedup_key": ""}):
        with pytest.raises(asyncjobq.ConfigurationError):
            await q.enqueue("t", {}, **kwargs)  # type: ignore[arg-type]


async def test_concurrent_enqueues_share_statements_and_keep_their_own_rows(
        queue: Queue) -> None:
    at = datetime.now(UTC) + timedelta(hours=1)

    async def one(i: int) -> tuple[int, int]:
        job_id = await queue.enqueue(f"t{i % 3}", {"i": i}, queue=f"q{i % 2}", priority=i % 7,
                                     max_attempts=1 + i % 4,
                                     **({"run_at": at} if i % 5 == 0 else {"delay": i}))
        return i, job_id

    assert queue._inserter is not None
    before = queue._inserter.statements
    pairs = await asyncio.gather(*(one(i) for i in range(300)))
    assert len({job_id for _, job_id in pairs}) == 300
    assert queue._inserter.statements - before < 300, "calls were not coalesced"
    for i, job_id in pairs:
        info = await queue.get(job_id)
        assert info is not None
        assert (info.task, info.payload, info.queue, info.priority, info.max_attempts) == (
            f"t{i % 3}", {"i": i}, f"q{i % 2}", i % 7, 1 + i % 4)
        if i % 5 == 0:
            assert info.run_at == at
        else:
            assert abs((info.run_at - info.created_at).total_seconds() - i) < 1


class GatedWrite:
    """The queue's real INSERT, held back until `gate` opens, so that calls pile up behind it."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.sizes: list[int] = []
        self.one_lane: list[bool] = []

    async def __call__(self, rows: list[str], one_lane: bool) -> list[int]:
        self.sizes.append(len(rows))
        self.one_lane.append(one_lane)
        self.entered.set()
        await self.gate.wait()
        return await self.queue._write_rows(rows, one_lane)


def _row(n: int, priority: str = "0") -> str:
    return f'["t",{{"n":{n}}},"default",{priority},null,0.0,3]'


async def test_a_row_the_server_refuses_fails_only_its_own_enqueue(queue: Queue) -> None:
    # Every value enqueue() passes is checked first, so a refused row is forced here through
    # the inserter itself: a priority that is not a number, in a batch with five good rows.
    write = GatedWrite(queue)
    inserter = Inserter(write, max_in_flight=1)
    first = asyncio.create_task(inserter.insert(_row(-1), "default"))
    await asyncio.wait_for(write.entered.wait(), 10)
    rows = [_row(n) for n in range(5)]
    rows.insert(2, _row(99, priority='"high"'))
    calls = [asyncio.create_task(inserter.insert(r, "default")) for r in rows]
    await asyncio.sleep(0)  # all six are pending behind the first
    write.gate.set()
    await asyncio.wait_for(first, 10)
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert write.sizes == [1, 6, 1, 1, 1, 1, 1, 1], "not one batch, then row by row"
    assert isinstance(results[2], EnqueueRefusedError), results[2]
    assert isinstance(results[2].__cause__, psycopg.errors.InvalidTextRepresentation)
    ids = [r for r in results if not isinstance(r, BaseException)]
    assert len(ids) == 5
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 6
    payloads = [(await queue.get(int(i))).payload for i in ids]  # type: ignore[union-attr]
    assert payloads == [{"n": n} for n in range(5)]


async def test_a_batch_of_one_lane_names_its_partition_and_notifies_it(queue: Queue) -> None:
    """A batch whose rows share queue and priority goes into the current partition and sends
    its one notification itself (sql/enqueue.py, `_notified`); one of several lanes goes
    through jobs, whose trigger notifies each queue. Either way, one notification per queue
    with the trigger's payload."""
    write = GatedWrite(queue)
    inserter = Inserter(write, max_in_flight=1)
    async with queue.connection() as listener:
        await listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(f"{queue.schema}_jobs")))
        first = asyncio.create_task(inserter.insert(_row(0), ("default", 0)))
        await asyncio.wait_for(write.entered.wait(), 10)
        one = [asyncio.create_task(inserter.insert(_row(n), ("default", 0))) for n in (1, 2)]
        await asyncio.sleep(0)
        write.gate.set()
        await asyncio.wait_for(asyncio.gather(first, *one), 10)
        mixed = '["t",{"n":3},"other",5,null,0.0,3]'
        write.gate.clear()
        write.entered.clear()
        head = asyncio.create_task(inserter.insert(_row(4), ("default", 0)))
        await asyncio.wait_for(write.entered.wait(), 10)
        two = [asyncio.create_task(inserter.insert(mixed, ("other", 5))),
               asyncio.create_task(inserter.insert(_row(5), ("default", 0)))]
        await asyncio.sleep(0)
        write.gate.set()
        await asyncio.wait_for(asyncio.gather(head, *two), 10)
        heard = [json.loads(n.payload) async for n in listener.notifies(timeout=5.0,
                                                                        stop_after=5)]
    assert write.sizes == [1, 2, 1, 2] and write.one_lane == [True, True, True, False]
    lanes = [(h["queue"], [lane[0] for lane in h["lanes"]]) for h in heard]
    assert lanes[:3] == [("default", [0])] * 3
    assert sorted(lanes[3:]) == [("default", [0]), ("other", [5])]
    assert all(h["run_at"] == h["lanes"][0][1] for h in heard)
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs_0") == 6


async def test_a_partition_batch_notifies_as_the_trigger_of_jobs_does(queue: Queue) -> None:
    """The same rows, one lane, through jobs (its trigger) and into the current partition
    (the statement's own notification): the same payload, earliest run_at included; a
    keyed enqueue_many names the partition and is heard too."""
    rows = json.dumps([["t", {}, "pay", 4, "2030-01-02T03:04:05.5+00:00", 7.25, 3],
                       ["t", {}, "pay", 4, "2030-01-02T03:04:00+00:00", 9.0, 3],
                       ["t", {}, "pay", 4, "2031-01-01T00:00:00+00:00", 0.0, 3]])
    async with queue.connection() as listener:
        await listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(f"{queue.schema}_jobs")))
        async with queue.connection() as conn:
            for statements in (queue.sql, queue.database.sql_of(0)):
                cur = await conn.execute(statements.job_insert_rows, {"rows": rows})
                assert len(await cur.fetchall()) == 3
        keyed = await queue.enqueue_many("t", [{}, {}], queue="keys", keys=["k", None])
        heard = [n.payload async for n in listener.notifies(timeout=5.0, stop_after=3)]
    assert heard[0] == heard[1]
    assert json.loads(heard[0])["run_at"] == datetime(2030, 1, 2, 3, 4, 9, tzinfo=UTC).timestamp()
    assert json.loads(heard[2])["queue"] == "keys"
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs_0 WHERE id = ANY(%s)",
                          keyed) == 2


async def test_batches_are_bounded_in_bytes(queue: Queue) -> None:
    write = GatedWrite(queue)
    inserter = Inserter(write, max_in_flight=1, max_bytes=3 * len(_row(10)))
    first = asyncio.create_task(inserter.insert(_row(0), "default"))
    await asyncio.wait_for(write.entered.wait(), 10)
    calls = [asyncio.create_task(inserter.insert(_row(n), "default")) for n in range(10, 17)]
    await asyncio.sleep(0)
    write.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *calls), 10)
    assert write.sizes == [1, 3, 3, 1]
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 8


async def test_a_statement_failure_reaches_every_caller(pg_dsn: str, schema: str) -> None:
    async with Queue(pg_dsn, schema=schema, pool_max_size=2) as q:  # never installed
        results = await asyncio.gather(*(q.enqueue("t", {"i": i}) for i in range(20)),
                                       return_exceptions=True)
        assert q._inserter is not None and q._inserter.statements < 20
    assert all(isinstance(r, asyncjobq.SchemaNotInstalledError) for r in results), results


async def test_enqueue_cancelled_before_its_insert_starts_writes_nothing(queue: Queue) -> None:
    write = GatedWrite(queue)
    inserter = Inserter(write, max_in_flight=1)
    first = asyncio.create_task(inserter.insert(_row(1), "default"))
    await asyncio.wait_for(write.entered.wait(), 10)
    second = asyncio.create_task(inserter.insert(_row(2), "default"))
    await asyncio.sleep(0)  # let it queue behind the first
    second.cancel()
    write.gate.set()
    job_id = await asyncio.wait_for(first, 10)
    with pytest.raises(asyncio.CancelledError):
        await second
    await asyncio.wait_for(inserter.drain(), 10)
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 1
    info = await queue.get(job_id)
    assert info is not None and info.payload == {"n": 1}


async def test_close_waits_for_enqueues_in_flight(pg_dsn: str, schema: str) -> None:
    async with Queue(pg_dsn, schema=schema) as q:
        await q.install()
        calls = [asyncio.create_task(q.enqueue("t", {"i": i})) for i in range(100)]
        await asyncio.sleep(0)  # all of them are inside enqueue() now
    ids = await asyncio.gather(*calls)
    async with Queue(pg_dsn, schema=schema) as q:
        assert await fetchval(q, "SELECT count(*) FROM {s}.jobs") == 100
        assert len(set(ids)) == 100


async def test_the_pool_grows_while_a_test_runs(queue: Queue) -> None:
    """Fixtures and tests share one event loop (pyproject's asyncio loop scopes): the pool's
    workers, which open its connections, run in the loop that opened it. In a loop of the
    fixture's own they never ran while a test did, so a second connection (or a replacement
    for a closed one) never came: a worker's resign waited 30 s for it under load in CI."""
    async with queue.connection() as first, asyncio.timeout(10):
        async with queue.connection() as second:
            assert first is not second
