"""Jobs in two generations (0013_generations.sql, src/asyncjobq/_maintenance/rotation.py): the
leader empties the other partition by TRUNCATE and makes it current, and no job is lost, run
twice or freed of its dedup_key, a running one moved keeps its outcome and its lease (also
when a statement waited for its row while it moved), a workflow's parent moved keeps its
children waiting, and a switch that cannot take its lock changes nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import TypeVar

import psycopg
import pytest
from conftest import execute, fetchval, running, wait_for
from psycopg import sql

from asyncjobq import Job, Queue, SchemaNotInstalledError, Worker
from asyncjobq._worker.completer import Completer
from asyncjobq._worker.fetcher import Fetcher
from asyncjobq._worker.misplaced import Mover
from asyncjobq._worker.outcome import Outcome

T = TypeVar("T")


async def _gen(q: Queue) -> int:
    return int(await fetchval(q, "SELECT gen FROM {s}.generation"))


async def _rotate(q: Queue) -> int:
    """One switch, as the leader runs it; the rows it moved (-1: it could not lock)."""
    async with q.connection() as conn:
        cur = await conn.execute(q.sql.generation_rotate, {"n": 5000})
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def _rows(q: Queue, query: str) -> list[tuple[object, ...]]:
    async with q.connection() as conn:
        cur = await conn.execute(sql.SQL(query).format(s=sql.Identifier(q.schema)))
        return list(await cur.fetchall())


async def _where(q: Queue) -> dict[int, tuple[int, str]]:
    async with q.connection() as conn:
        cur = await conn.execute(sql.SQL("SELECT id, gen, status::text FROM {}.jobs").format(
            sql.Identifier(q.schema)))
        return {int(i): (int(g), s) for i, g, s in await cur.fetchall()}


async def test_a_switch_empties_the_other_partition_and_keeps_every_live_row(
        queue: Queue) -> None:
    ids = [await queue.enqueue("t", {"n": n}) for n in range(6)]
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', locked_by = 'w',"
                         " attempts = 1 WHERE id = %s", ids[0])
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id = %s", ids[1])
    assert await _gen(queue) == 0
    assert await _rotate(queue) >= 4  # the queued rows, into the new current partition
    assert await _gen(queue) == 1
    where = await _where(queue)
    assert {i: g for i, (g, s) in where.items() if s == "queued"} == {i: 1 for i in ids[2:]}
    assert where[ids[0]] == (0, "running") and where[ids[1]] == (0, "failed")
    # The next switch empties jobs_0: its running and failed rows move to jobs_1, the queued
    # ones on to jobs_0, current again. Nothing is lost.
    assert await _rotate(queue) >= 2 + 4
    assert await _gen(queue) == 0
    where = await _where(queue)
    assert sorted(where) == sorted(ids)
    assert where[ids[0]] == (1, "running") and where[ids[1]] == (1, "failed")
    assert {i: g for i, (g, s) in where.items() if s == "queued"} == {i: 0 for i in ids[2:]}
    # Ids carry on from the same sequence.
    assert await queue.enqueue("t", {}) > max(ids)


async def test_every_enqueue_path_writes_the_current_generation(queue: Queue) -> None:
    """The library's inserts name `gen` themselves (_db/sql/enqueue.py), not by the default:
    after each switch, each of its statements writes into the partition made current."""
    for want in (1, 0):
        assert await _rotate(queue) >= 0 and await _gen(queue) == want
        ids = [await queue.enqueue("t", {}),  # the inserter's rows
               await queue.enqueue("t", {}, dedup_key=f"k{want}"),  # one VALUES row
               await queue.enqueue("t", {}, key="a"),
               *await queue.enqueue_many("t", [{}, {}]),
               *await queue.enqueue_many("t", [{}], keys=["b"])]
        async with queue.connection() as conn, conn.transaction():  # the caller's
            ids.append(await queue.enqueue("t", {}, conn=conn))
        tick = f"2030-01-0{2 - want}T00:00:00Z"  # each later than the one before
        async with queue.connection() as conn:  # a periodic tick, as the leader writes it
            spec = ["every", "t", {}, "default", 0, 3]
            await conn.execute(queue.sql.periodic_ticks_enqueue, {
                "schedules": json.dumps([spec]), "channel": queue.database.channel,
                "ticks": json.dumps([["every", tick, True]])})
        ids.append(int(await fetchval(queue, "SELECT id FROM {s}.jobs WHERE run_at = %s",
                                      tick)))
        where = await _where(queue)
        assert {i: where[i][0] for i in ids} == {i: want for i in ids}


async def test_an_enqueue_into_a_schema_before_generations_says_to_install(
        queue: Queue) -> None:
    older = r"older than this asyncjobq.*install"
    await execute(queue, "ALTER TABLE {s}.generation RENAME TO generation_hidden")
    try:
        with pytest.raises(SchemaNotInstalledError, match=older):
            await queue.enqueue("t", {}, dedup_key="k")
        with pytest.raises(SchemaNotInstalledError, match=older):
            await queue.enqueue_many("t", [{}])
        with pytest.raises(SchemaNotInstalledError, match=older):
            await queue.enqueue("t", {})  # through the inserter
    finally:
        await execute(queue, "ALTER TABLE {s}.generation_hidden RENAME TO generation")
    assert await queue.enqueue("t", {}) > 0


async def test_a_dedup_key_stays_held_across_switches(queue: Queue) -> None:
    first = await queue.enqueue("t", {}, dedup_key="k")
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', locked_by = 'w',"
                         " attempts = 1 WHERE id = %s", first)
    await _rotate(queue)  # the running job stays in jobs_0, inserts go to jobs_1
    assert await queue.enqueue("t", {}, dedup_key="k") == first
    await _rotate(queue)  # and now it moves
    assert await queue.enqueue("t", {}, dedup_key="k") == first
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE dedup_key = 'k'") == 1
    # Its end frees the key: a move did not.
    await execute(queue, "DELETE FROM {s}.jobs WHERE id = %s", first)
    second = await queue.enqueue("t", {}, dedup_key="k")
    assert second != first
    assert await fetchval(queue, "SELECT job_id FROM {s}.job_keys WHERE dedup_key = 'k'") \
        == second


async def test_a_failed_job_with_a_held_key_is_not_requeued(queue: Queue) -> None:
    old = await queue.enqueue("t", {}, dedup_key="k")
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id = %s", old)
    live = await queue.enqueue("t", {}, dedup_key="k")
    assert live != old
    await _rotate(queue)
    with pytest.raises(psycopg.errors.UniqueViolation):
        await execute(queue, "UPDATE {s}.jobs SET status = 'queued', finished_at = NULL"
                             " WHERE id = %s", old)


async def test_a_keys_holder_follows_its_status_changes(queue: Queue) -> None:
    """One trigger (0014_key_trigger.sql) frees the key of a job that stops being live and
    takes it for one that becomes live again, whichever columns a statement sets; its WHEN
    (0015_key_when.sql) leaves only a claim out, and the function decides the rest."""
    async def holder() -> int | None:
        return await fetchval(queue, "SELECT job_id FROM {s}.job_keys WHERE dedup_key = 'k'")

    job = await queue.enqueue("t", {}, dedup_key="k")
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', locked_by = 'w',"
                         " attempts = 1 WHERE id = %s", job)  # live to live: kept
    assert await holder() == job
    await execute(queue, "UPDATE {s}.jobs SET status = 'queued', finished_at = NULL"
                         " WHERE id = %s", job)  # a retry, live to live: kept
    assert await holder() == job
    await execute(queue, "UPDATE {s}.jobs SET status = 'running' WHERE id = %s", job)
    await execute(queue, "UPDATE {s}.jobs SET status = 'cancelled' WHERE id = %s", job)
    assert await holder() is None
    await execute(queue, "UPDATE {s}.jobs SET status = 'queued' WHERE id = %s", job)
    assert await holder() == job
    assert await queue.enqueue("t", {}, dedup_key="k") == job
    # A row inserted ended (by hand) takes no key; a delete of one frees none.
    ended = await fetchval(queue, "INSERT INTO {s}.jobs (task, payload, status, dedup_key)"
                                  " VALUES ('t', '{{}}', 'failed', 'k2') RETURNING id")
    assert ended is not None
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_keys WHERE dedup_key = 'k2'") == 0
    await execute(queue, "UPDATE {s}.jobs SET dedup_key = 'k' WHERE id = %s", ended)
    await execute(queue, "DELETE FROM {s}.jobs WHERE id = %s", ended)
    assert await holder() == job
    # The update's WHEN tells an ended status by its place in the enum: every value but
    # queued and running sorts after running.
    assert await _rows(queue, "SELECT s FROM unnest(enum_range(NULL::{s}.job_status)) s"
                              " WHERE s::text NOT IN ('queued', 'running')"
                              " AND s <= 'running'") == []
    assert [n for (n,) in await _rows(queue, "SELECT tgname FROM pg_trigger WHERE tgrelid ="
                                             " '{s}.jobs'::regclass AND tgname LIKE 'jobs_key%%'"
                                             " ORDER BY 1")] == [
        "jobs_key_delete", "jobs_key_insert", "jobs_key_update"]


async def test_batch_inserts_name_the_current_partition_and_follow_a_switch(
        queue: Queue) -> None:
    """Coalesced enqueues and enqueue_many go straight into the current generation's
    partition, and notify their lane themselves (sql/enqueue.py); after a switch, the
    statement that names the old one inserts nothing and is sent again for the new one: each
    job once, in the current partition, and a listener hears of it."""
    first = await queue.enqueue("t", {})
    assert queue._partitions is not None and queue._partitions.usable
    assert (await _where(queue))[first] == (0, "queued")
    assert await _rotate(queue) >= 1
    assert await _gen(queue) == 1
    async with queue.connection() as listener:
        await listener.set_autocommit(True)
        await listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(f"{queue.schema}_jobs")))
        ids = await queue.enqueue_many("t", [{"n": i} for i in range(3)], queue="other")
        heard = await asyncio.wait_for(anext(listener.notifies()), timeout=10)
    assert json.loads(heard.payload)["queue"] == "other"
    assert queue._partitions.guess == 1
    after = await queue.enqueue("t", {})
    where = await _where(queue)
    assert [where[i] for i in [*ids, after]] == [(1, "queued")] * 4
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 5
    # Through jobs where the partitions cannot be named: the same rows, routed.
    queue._partitions.usable = False
    routed = await queue.enqueue_many("t", [{}, {}])
    assert [(await _where(queue))[i] for i in routed] == [(1, "queued")] * 2


async def test_moves_between_partitions_notify_only_their_queued_rows(queue: Queue) -> None:
    """Moves between the partitions notify only the queued rows they move (jobs_move,
    0013_generations.sql): a failed row drained from the old partition wakes no worker of its
    queue."""
    failed = await queue.enqueue("t", {}, queue="ended")
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id = %s", failed)
    assert await _rotate(queue) >= 0
    async with queue.connection() as listener:
        await listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(f"{queue.schema}_jobs")))
        async with queue.connection() as conn:
            await conn.execute(queue.sql.generation_drain, {"n": 100})
        assert (await _where(queue))[failed] == (1, "failed")
        await queue.enqueue("t", {}, queue="after")  # notifications arrive in commit order
        heard = await asyncio.wait_for(anext(listener.notifies()), timeout=10)
    assert json.loads(heard.payload)["queue"] == "after"


async def test_a_switch_waits_for_no_lock_and_changes_nothing_without_it(
        queue: Queue, pg_dsn: str) -> None:
    await queue.enqueue("t", {})
    with psycopg.connect(pg_dsn) as holder:  # idle in a transaction that read jobs_1
        holder.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(
            sql.Identifier(queue.schema)))
        assert await _rotate(queue) == -1
        assert await _gen(queue) == 0
        holder.rollback()
    assert await _rotate(queue) >= 1


@pytest.mark.parametrize("switch_mb", [0.05])
async def test_jobs_flow_through_many_switches_each_done_once(
        queue: Queue, monkeypatch: pytest.MonkeyPatch, switch_mb: float) -> None:
    """The leader switches whenever the current partition passes 50 kB (and twice what it held
    after its last switch), while 4,000 jobs or more are enqueued, a quarter of them retried
    once, and completed: every job done exactly once, across at least 3 switches."""
    monkeypatch.setenv("ASYNCJOBQ_ROTATION", "always")
    monkeypatch.setenv("ASYNCJOBQ_ROTATE_MB", str(switch_mb))
    done: Counter[int] = Counter()
    tries: Counter[int] = Counter()

    @queue.task(name="t", max_attempts=3, backoff=lambda attempt: 0.0)
    async def t(job: Job) -> None:
        tries[job.id] += 1
        if tries[job.id] == 1 and job.id % 4 == 0:
            raise RuntimeError("once")
        done[job.id] += 1

    w = Worker(queue, concurrency=20, batch_size=10, poll_interval=0.2)
    ids: list[int] = []
    async with running(w):
        w.rotation.interval = 0.2
        # 4,000 jobs at least, and on until the leader has switched 3 times (a loaded machine
        # drains slower, and switches later).
        for rounds in range(400):
            ids += await queue.enqueue_many("t", [{}] * 100)
            await asyncio.sleep(0.1)
            if rounds >= 40 and w.rotation.switches >= 3:
                break
        await wait_for(lambda: len(done) == len(ids), 60, what="every job done")
        assert w.rotation.switches >= 3, w.rotation.switches
    assert set(done) == set(ids)
    assert max(done.values()) == 1
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 0


async def test_a_running_job_moved_by_a_switch_keeps_its_outcome(queue: Queue) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    done: list[int] = []

    @queue.task(name="slow")
    async def slow(job: Job) -> str:
        started.set()
        await release.wait()
        done.append(job.id)
        return "ok"

    w = Worker(queue, concurrency=2, poll_interval=0.1)
    async with running(w):
        job_id = await slow.enqueue({})
        await asyncio.wait_for(started.wait(), 10)
        await _rotate(queue)  # inserts go to jobs_1; the running row stays in jobs_0
        await _rotate(queue)  # jobs_0 emptied: the running row moved to jobs_1
        assert (await _where(queue))[job_id] == (1, "running")
        release.set()
        await wait_for(lambda: done == [job_id], 10, what="the job done")
        await wait_for(lambda: w.completed == 1, 10, what="its outcome written")
    assert w.completer is not None and w.completer.refused == 0
    result = await queue.get(job_id)
    assert result is not None and result.status == "done" and result.result == "ok"


async def test_a_parent_moved_by_a_switch_still_releases_its_child(queue: Queue) -> None:
    parent = await queue.enqueue("p", {})
    child = await queue.enqueue("c", {}, after=[parent])
    assert (await _where(queue))[child][1] == "waiting"
    await _rotate(queue)
    await _rotate(queue)  # both moved twice: no end of the parent was seen
    assert (await _where(queue))[child][1] == "waiting"
    ran: list[str] = []

    @queue.task(name="p")
    async def p(job: Job) -> None:
        ran.append("p")

    @queue.task(name="c")
    async def c(job: Job) -> None:
        ran.append("c")

    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: ran == ["p", "c"], 20, what="the parent, then its child")


async def test_a_switch_refuses_an_isolation_other_than_read_committed(queue: Queue) -> None:
    async with queue.connection() as conn:
        async with conn.transaction():
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            with pytest.raises(psycopg.errors.FeatureNotSupported, match="READ COMMITTED"):
                await conn.execute(queue.sql.generation_rotate, {"n": 10})
    assert await _gen(queue) == 0


async def test_version_12_upgrades_keeping_every_job_its_id_and_key(
        pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table as it was becomes jobs_0: queued, running, failed and keyed jobs stay, ids
    carry on after the highest one drawn, and the keys of live jobs are held."""
    from asyncjobq._db import migrations

    every = migrations.available()
    monkeypatch.setattr(migrations, "available", lambda: [m for m in every if m.version <= 12])
    q = Queue(pg_dsn, schema=schema)
    async with q:
        assert await q.install() == list(range(1, 13))
        await execute(q, "INSERT INTO {s}.jobs (task, payload, dedup_key) SELECT 't', '{{}}',"
                         " CASE WHEN g %% 10 = 0 THEN 'k' || g END FROM generate_series(1, 1000) g")
        await execute(q, "UPDATE {s}.jobs SET status = 'running', locked_by = 'w', attempts = 1"
                         " WHERE id %% 7 = 0")
        await execute(q, "UPDATE {s}.jobs SET status = 'failed', finished_at = now()"
                         " WHERE id %% 11 = 0 AND status = 'queued'")
        await execute(q, "DELETE FROM {s}.jobs WHERE id > 990")  # drawn, gone
        before = {int(i): s for i, s in await _rows(q, "SELECT id, status::text FROM {s}.jobs")}
        monkeypatch.setattr(migrations, "available", lambda: every)
        assert await q.install() == [m.version for m in every if m.version > 12]
        after = await _where(q)
        assert {i: s for i, (_, s) in after.items()} == before
        assert {g for g, _ in after.values()} == {0}
        assert await q.enqueue("t", {}) == 1001
        live_keys = await fetchval(q, "SELECT count(*) FROM {s}.jobs WHERE dedup_key IS NOT NULL"
                                      " AND status IN ('queued', 'running')")
        assert await fetchval(q, "SELECT count(*) FROM {s}.job_keys") == live_keys > 0
        held = await fetchval(q, "SELECT dedup_key FROM {s}.jobs WHERE dedup_key IS NOT NULL"
                                 " AND status = 'queued' ORDER BY id LIMIT 1")
        first = await fetchval(q, "SELECT id FROM {s}.jobs WHERE dedup_key = %s", held)
        assert await q.enqueue("t", {}, dedup_key=held) == first


@pytest.mark.parametrize(("name", "value"), [("ASYNCJOBQ_ROTATE_MB", "lots"),
                                             ("ASYNCJOBQ_ROTATE_MB", "-1"),
                                             ("ASYNCJOBQ_ROTATION", "sometimes")])
async def test_a_bad_rotation_setting_is_refused_saying_what_to_give(
        queue: Queue, monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    from asyncjobq import ConfigurationError
    from asyncjobq._maintenance.rotation import Rotation

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError, match=f"{name}={value!r}: "):
        Rotation(queue.database)


async def test_an_install_ended_by_a_deadlock_is_tried_again(
        pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 14 changes triggers of `jobs`, which locks it and then its partitions. A
    session that holds a partition and then reads `jobs` (a limited claim does) closes a cycle;
    PostgreSQL ends the install's transaction, and install tries it again once the other
    session is done, instead of failing (migrations.DEADLOCK_TRIES)."""
    import threading

    from asyncjobq._db import migrations

    every = migrations.available()
    monkeypatch.setattr(migrations, "available", lambda: [m for m in every if m.version <= 13])
    q = Queue(pg_dsn, schema=schema)
    s = sql.Identifier(schema)
    read: list[int] = []
    holding = threading.Event()

    def other_session() -> None:
        with psycopg.connect(pg_dsn) as c, psycopg.connect(pg_dsn, autocommit=True) as look:
            # This session never runs the deadlock check first: the install's does.
            c.execute("SET deadlock_timeout = '20s'")
            c.execute(sql.SQL("UPDATE {}.jobs_0 SET priority = 0 WHERE false").format(s))
            holding.set()
            deadline = time.monotonic() + 10
            while not look.execute(
                    "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted"
                    " AND relation = %s::regclass)", (f'"{schema}".jobs_0',)).fetchone()[0]:
                assert time.monotonic() < deadline, "the install never waited for jobs_0"
                time.sleep(0.01)
            read.append(c.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(s)
                                  ).fetchone()[0])
            c.rollback()

    async with q:
        assert await q.install() == list(range(1, 14))
        monkeypatch.setattr(migrations, "available", lambda: every)
        thread = threading.Thread(target=other_session)
        thread.start()
        try:
            await asyncio.to_thread(holding.wait, 10)
            applied = await q.install()
        finally:
            await asyncio.to_thread(thread.join)
    assert read == [0]  # the other session was not the one ended
    assert applied == [m.version for m in every if m.version > 13]


async def _while_moved(queue: Queue, pg_dsn: str, statement: Awaitable[T], what: str) -> T:
    """Runs `statement` (it writes to a running job in jobs_0, jobs_1 being current) while
    the leader's drain moves the job into jobs_1: it waits for the row, and the move commits.
    Its snapshot predates the move: the version it finds is deleted, the moved one unseen."""
    async with await psycopg.AsyncConnection.connect(pg_dsn) as mover:
        await mover.execute(sql.SQL("SELECT {}.drain_old_jobs(100)").format(
            sql.Identifier(queue.schema)))  # moved, not committed: the row stays locked
        cur = await mover.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        task = asyncio.ensure_future(statement)
        try:
            await wait_for(lambda: fetchval(queue, "SELECT count(*) > 0 FROM pg_stat_activity"
                                            " WHERE %s = ANY(pg_blocking_pids(pid))", row[0]),
                           10, what=f"{what} waiting for the moved row")
        except BaseException:
            task.cancel()
            raise
        await mover.commit()
    return await asyncio.wait_for(task, 10)


async def test_a_completion_that_waited_for_a_moved_row_finds_it_again(
        queue: Queue, pg_dsn: str) -> None:
    """A flush through `jobs` (no partition named: a pooled flush, a worker with limited
    tasks, a batch from both generations) that waits for a row the leader's drain is moving
    finds the old version deleted, and the moved one is newer than its snapshot. Its second
    look, a statement of its own, finds the job in the current partition: refused there, the
    finished job would be reaped and run again."""
    job_id = (await queue.enqueue_many("t", [{}]))[0]
    fetcher = Fetcher(queue.database, "w", ["default"], batch_size=1, concurrency=1,
                      poll_interval=1, free_slots=lambda: 1, dispatch=lambda j: None)
    fetcher.gen = 0
    (job,) = await fetcher.claim(1)
    assert await _rotate(queue) == 0  # jobs_1 is current; the running row stays in jobs_0
    completer = Completer(queue.database, "w", max_batch=10)  # no fetcher: through `jobs`
    completer.add(Outcome(job.id, job.attempt, "done"))
    await _while_moved(queue, pg_dsn, completer.flush(), "the flush")
    assert completer.refused == 0
    info = await queue.get(job_id)
    assert info is not None and info.status == "done"
    assert (await queue.stats())["default"]["done"] == 1


async def test_a_heartbeat_that_waited_for_a_moved_row_keeps_the_lease(
        queue: Queue, pg_dsn: str) -> None:
    """A heartbeat that waits for the row of a running job while the leader's drain moves it
    finds the old version deleted: its second look finds the job in the current partition.
    Taken for lost, the handler would be cancelled and the job reaped and run again."""
    started = asyncio.Event()
    release = asyncio.Event()

    @queue.task(name="slow")
    async def slow(job: Job) -> str:
        started.set()
        await release.wait()
        return "ok"

    # A lease of 300 s: the only beat in the test is the one it sends.
    w = Worker(queue, concurrency=2, poll_interval=0.1, lease=300)
    async with running(w):
        job_id = await slow.enqueue({})
        await asyncio.wait_for(started.wait(), 10)
        await _rotate(queue)  # jobs_1 is current; the running row stays in jobs_0
        assert w.heartbeat is not None
        beats = w.heartbeat.beats
        await _while_moved(queue, pg_dsn, w.heartbeat.beat(), "the heartbeat")
        assert w.heartbeat.beats == beats + 1
        assert (await _where(queue))[job_id] == (1, "running")
        release.set()
        await wait_for(lambda: w.completed == 1, 10, what="its outcome written")
    assert w.completer is not None and w.completer.refused == 0
    result = await queue.get(job_id)
    assert result is not None and result.status == "done" and result.result == "ok"


async def test_a_misplaced_job_moved_meanwhile_still_goes_to_its_queue(
        queue: Queue, pg_dsn: str) -> None:
    """A worker that claimed a limited task's job outside the task's queue sends it there
    (_worker/misplaced.py). Waiting for its row while the leader's drain moves it, the UPDATE
    finds it deleted; the second look moves it: left running, the job would wait for the
    reaper and lose an attempt it never ran."""
    @queue.task(name="export", queue="exports", rate_limit="5/s")
    async def export(job: Job) -> None:
        pass

    job_id = await fetchval(queue, "SELECT {s}.enqueue('export', '{{}}')")  # into 'default'
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                  " locked_by = 'w', locked_at = now() WHERE id = %s", job_id)
    assert await _rotate(queue) == 0  # jobs_1 is current; the running row stays in jobs_0
    job = Job(id=job_id, task="export", queue="default", payload={}, priority=0, attempt=1,
              max_attempts=3, run_at=datetime.now(UTC), created_at=datetime.now(UTC),
              worker="w")
    assert await _while_moved(queue, pg_dsn, Mover(queue.database, "w").move(job, export),
                              "the move to the task's queue") is True
    assert (await _where(queue))[job_id] == (1, "queued")
    assert await fetchval(queue, "SELECT queue FROM {s}.jobs WHERE id = %s", job_id) == "exports"


@pytest.mark.parametrize("end", ["done", "failed"])
async def test_a_child_moved_while_its_parent_ends_is_still_settled(
        queue: Queue, pg_dsn: str, end: str) -> None:
    """A parent's end settles its waiting children in the statement that ends it
    (job_deps_settle): done releases them, dead-lettered cancels them and theirs. Waiting for
    a child's row while the leader's drain moves it, that statement finds it deleted: the
    child is looked for again by a statement of its own (0016_settle_moved.sql). Missed, the
    edge counted as applied and the child waited for ever. Its sibling, in the current
    partition, is settled by the first statement, and the sibling's own child by the next
    round, whose parents are the children cancelled by both."""
    parent = await queue.enqueue("p", {})
    child = await queue.enqueue("c", {}, after=[parent])
    await _rotate(queue)  # jobs_1 is current, the parent queued there; the child in jobs_0
    sibling = await queue.enqueue("c", {}, after=[parent])  # in jobs_1
    grandchild = await queue.enqueue("g", {}, after=[sibling])
    where = await _where(queue)
    assert [where[i] for i in (child, grandchild, sibling)] == [
        (0, "waiting"), (1, "waiting"), (1, "waiting")]
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                  " locked_by = 'w', locked_at = now() WHERE id = %s", parent)
    completer = Completer(queue.database, "w", max_batch=10)  # through `jobs`
    completer.add(Outcome(parent, 1, end, error="boom" if end == "failed" else None))
    await _while_moved(queue, pg_dsn, completer.flush(), "the parent's end")
    assert completer.refused == 0
    where = await _where(queue)
    if end == "done":
        assert [where[i] for i in (child, grandchild, sibling)] == [
            (1, "queued"), (1, "waiting"), (1, "queued")]
        assert await fetchval(queue, "SELECT pending FROM {s}.jobs WHERE id = %s", child) == 0
        return
    assert not {child, grandchild, sibling} & set(where)
    why = {i: f"parent {p} was {how}" for i, p, how in (
        (child, parent, "dead-lettered"), (sibling, parent, "dead-lettered"),
        (grandchild, sibling, "cancelled"))}
    for i, error in why.items():
        info = await queue.get(i)
        assert info is not None and info.status == "cancelled", info
        assert info.last_error == error, info
    assert (await queue.stats())["default"]["cancelled"] == 3
