"""stats() and `status` in bounded time whatever the size of history (issue 17, item 8): history
is counted by triggers into history_counts (0003_history_counts.sql), and those counts stay
exact through workers' completions, retries, cancel, retry_failed, prune, the leader's fold, an
operator's UPDATE or TRUNCATE, and the migration's backfill of a history that already exists,
even while writers wait on it. Real PostgreSQL; plans are read, not timed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from conftest import counted, execute, fetchval, run_cli, running, wait_for
from psycopg import sql

from asyncjobq import Fail, Job, Queue, Retention, Worker
from asyncjobq._db import migrations
from asyncjobq._maintenance.pruner import Pruner

# What an upgrade from version 2 applies: 0003 (the counts) and whatever came after it.
LATER_THAN_2 = sorted(m.version for m in migrations.available() if m.version > 2)

TRUE_COUNTS = (
    "SELECT queue, status::text, count(*) FROM {s}.jobs GROUP BY 1, 2"
    " UNION ALL SELECT queue, status::text, count(*) FROM {s}.jobs_history GROUP BY 1, 2")


async def true_counts(q: Queue) -> dict[str, dict[str, int]]:
    """What stats() must say, counted the slow way."""
    out: dict[str, dict[str, int]] = {}
    async with q.connection() as conn:
        cur = await conn.execute(sql.SQL(TRUE_COUNTS).format(s=sql.Identifier(q.schema)))
        for queue, status, n in await cur.fetchall():
            out.setdefault(queue, dict.fromkeys(
                ("queued", "running", "done", "failed", "cancelled"), 0))[status] += n
    return out


async def assert_exact(q: Queue) -> None:
    assert await q.stats() == await true_counts(q)


def fill_history(n: int, *, queues: tuple[str, ...] = ("a", "b", "c"),
                 minutes_ago: int = 60 * 24, count: bool = True) -> str:
    # Done, cancelled and a few failed rows (an operator may put any status there), finished
    # `minutes_ago` minutes ago, ids below every real job's. `count`: counted as asyncjobq's
    # writers count (a schema before version 3 has no counts).
    qs = ", ".join(f"'{q}'" for q in queues)
    insert = (
        "INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at,"
        " attempts, max_attempts, created_at, finished_at)"
        f" SELECT (SELECT least(min(id), 0) FROM {{s}}.jobs_history) - g,"
        f"   (ARRAY[{qs}])[1 + mod(g, {len(queues)})], 'old', '{{{{}}}}',"
        "   (CASE WHEN mod(g, 20) = 0 THEN 'failed' WHEN mod(g, 10) = 1 THEN 'cancelled'"
        "    ELSE 'done' END)::{s}.job_status, 0, now(), 1, 3,"
        f"   now() - interval '{minutes_ago + 1} minutes', now() - interval '{minutes_ago} minutes'"
        f" FROM generate_series(1, {n}) g")
    return counted(insert) if count else insert


@contextmanager
def recorded_statements() -> Iterator[list[tuple[Any, Any]]]:
    """Every statement asyncjobq sends through an async connection in the block."""
    seen: list[tuple[Any, Any]] = []
    original = psycopg.AsyncConnection.execute

    async def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        seen.append((query, params))
        return await original(self, query, params, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(psycopg.AsyncConnection, "execute", execute)
        yield seen


async def history_reads(q: Queue, query: Any, params: Any) -> list[tuple[str, int, int]]:
    """(node type, blocks, rows) of each plan node that reads jobs_history, run for real."""
    async with q.connection() as conn:
        cur = await conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query, params)
        row = await cur.fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    found: list[tuple[str, int, int]] = []
    nodes = [plan[0]["Plan"]]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", []))
        if node.get("Relation Name") == "jobs_history":
            found.append((node["Node Type"],
                          node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0),
                          node["Actual Rows"] * node["Actual Loops"]))
    return found


async def install_up_to(q: Queue, version: int) -> None:
    """The schema as an older asyncjobq installed it: the migrations up to `version` only."""
    st = q.sql
    async with q.connection() as conn, conn.transaction():
        await conn.execute(st.schema_create)
        await conn.execute(st.migrations_table_create)
        await conn.execute(st.search_path_set_local)
        for m in migrations.available():
            if m.version <= version:
                await conn.execute(sql.SQL(m.text))
                await conn.execute(st.migration_record, (m.version, m.name))


@asynccontextmanager
async def old_schema(pg_dsn: str, schema: str) -> AsyncIterator[Queue]:
    q = Queue(pg_dsn, schema=schema, pool_max_size=10)
    async with q:
        await install_up_to(q, 2)
        yield q


# --- bounded -------------------------------------------------------------------------------


async def test_stats_reads_no_history_whatever_its_size(queue: Queue) -> None:
    await execute(queue, fill_history(30_000))
    await execute(queue, "ANALYZE {s}.jobs_history")
    await queue.enqueue_many("t", [{}] * 3, queue="a")
    with recorded_statements() as seen:
        stats = await queue.stats()
    assert stats == await true_counts(queue)
    assert stats["a"]["queued"] == 3 and sum(c["done"] for c in stats.values()) == 25_500
    assert seen, "stats() ran no statement through an async connection"
    for query, params in seen:
        assert await history_reads(queue, query, params) == [], \
            "stats() reads jobs_history: it counts every finished job on every call"


async def test_a_page_of_history_is_newest_first_and_bounded(queue: Queue) -> None:
    """A page of a queue's history (no task) reads one range of jobs_history_queue_browse_idx
    per (queue, status): ids of several tasks interleaved come out newest first, and the page
    of a rare queue whose jobs are the oldest reads a few blocks of a history of 30,000 rows,
    not all of it backwards. Dropping that index (every completion writes an entry in it, 3.6
    us of server CPU a job at batch 10) made such pages walk the task index's (task, queue)
    pairs: a pinned horizon over pruned rows, or many tasks times many queues, then cost
    hundreds of milliseconds a page (docs/how-it-works/claim.md)."""
    await execute(queue, fill_history(30_000))
    # Three tasks interleaved by id in queue a, one of them in queue b too.
    await execute(queue, counted(
        "INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at,"
        " attempts, max_attempts, created_at, finished_at)"
        " SELECT 1000000 + g, CASE WHEN g %% 7 = 0 THEN 'b' ELSE 'a' END,"
        "   't' || (g %% 3), '{{}}', 'done', 0, now(), 1, 3, now(), now()"
        " FROM generate_series(1, 90) g"))
    # A rare queue whose jobs are the oldest: history read backwards by id would pass every
    # other row before it found them.
    await execute(queue, counted(
        "INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at,"
        " attempts, max_attempts, created_at, finished_at)"
        " SELECT -1000000 - g, 'rare', 't' || g, '{{}}', 'done', 0, now(), 1, 3, now(), now()"
        " FROM generate_series(1, 3) g"))
    await execute(queue, "ANALYZE {s}.jobs_history")
    newest_a = [1000000 + g for g in range(90, 0, -1) if g % 7]
    first = await queue.list_jobs(queue="a", status="done", limit=20)
    assert [j.id for j in first.jobs] == newest_a[:20]
    assert {j.task for j in first.jobs} == {"t0", "t1", "t2"}
    second = await queue.list_jobs(queue="a", status="done", limit=20, before=first.next_before)
    assert [j.id for j in second.jobs] == newest_a[20:40]
    everything = await queue.list_jobs(status="done", limit=90)
    assert [j.id for j in everything.jobs] == list(range(1000090, 1000000, -1))
    rare = await queue.list_jobs(queue="rare", status="done")
    assert [j.id for j in rare.jobs] == [-1000001, -1000002, -1000003]
    statement = queue.sql.job_page(queue=True, task=False, statuses=["done"])
    params = {"queue": "rare", "statuses": ["done"], "before": 2**63 - 1, "limit": 51}
    reads = await history_reads(queue, statement, params)
    assert reads and all(node != "Seq Scan" for node, _, _ in reads), reads
    # The whole statement's blocks (a node's count includes its InitPlans').
    async with queue.connection() as conn:
        cur = await conn.execute(
            sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + statement, params)
        row = await cur.fetchone()
    assert row is not None
    root = (row[0] if isinstance(row[0], list) else json.loads(row[0]))[0]["Plan"]
    assert root["Shared Hit Blocks"] + root.get("Shared Read Blocks", 0) < 100, reads


async def test_status_reads_only_recent_history(queue: Queue) -> None:
    """Every statement `status` runs (the schema check, stats, health, leader): history is
    read only where rows finished in the last minute can be, through the BRIN index."""
    await execute(queue, fill_history(200_000))
    await execute(queue, fill_history(300, queues=("recent",), minutes_ago=0))
    # As autovacuum (with the index's autosummarize) leaves it: every full range summarized.
    await execute(queue, "VACUUM ANALYZE {s}.jobs_history")
    pages = await fetchval(queue, "SELECT relpages FROM pg_class WHERE oid = %s::regclass",
                           f"{queue.schema}.jobs_history")
    assert pages > 2000
    with recorded_statements() as seen:
        async with queue.connection() as conn:
            await migrations.check(conn, queue.schema)
        health = await queue.health()
        await queue.stats()
        await queue.leader()
    assert health["recent"]["done_last_minute"] == 255
    assert "a" not in health, "a queue with no recent history and no live job is not listed"
    for query, params in seen:
        reads = await history_reads(queue, query, params)
        assert all(kind != "Seq Scan" for kind, _, _ in reads), (str(query), reads)
        # The ranges (128 pages each) that hold the last minute's rows, not the table; the
        # last minute's rows, not the index's every entry.
        assert sum(blocks for _, blocks, _ in reads) < 400, (str(query), reads, pages)
        assert sum(rows for _, _, rows in reads) <= 300, (str(query), reads)


# --- exact -----------------------------------------------------------------------------------


async def test_counts_stay_exact_through_workers_retries_cancel_prune_and_fold(
        queue: Queue) -> None:
    @queue.task(name="ok")
    async def ok(job: Job) -> None:
        pass

    @queue.task(name="flaky", backoff=lambda attempt: 0)
    async def flaky(job: Job) -> None:
        if job.attempt == 1:
            raise RuntimeError("first attempt fails")

    @queue.task(name="doomed")
    async def doomed(job: Job) -> None:
        raise Fail("never works")

    for q in ("a", "b"):
        await queue.enqueue_many(ok, [{}] * 150, queue=q)
        await queue.enqueue_many(flaky, [{}] * 30, queue=q)
        await queue.enqueue_many(doomed, [{}] * 10, queue=q)
    later = await queue.enqueue_many(ok, [{}] * 20, queue="b", delay=3600)
    await assert_exact(queue)

    workers = [Worker(queue, queues=("a", "b"), concurrency=8, poll_interval=0.1)
               for _ in range(3)]
    async with running(workers[0]), running(workers[1]), running(workers[2]):
        # Cancels write history beside the completers.
        assert all(await asyncio.gather(*(queue.cancel(i) for i in later[:12])))

        async def finished() -> bool:
            stats = await queue.stats()
            return sum(c["done"] + c["failed"] for c in stats.values()) == 380
        await wait_for(finished, what="every job done or failed")
    stats = await queue.stats()
    assert {q: (c["done"], c["failed"], c["cancelled"], c["queued"])
            for q, c in stats.items()} == {"a": (180, 10, 0, 0), "b": (180, 10, 12, 8)}
    await assert_exact(queue)
    # The cancel of many (the dashboard's bulk action) counts its rows too.
    assert await queue.cancel_queued(queue="b", limit=5) == 5
    assert (await queue.stats())["b"]["cancelled"] == 17
    await assert_exact(queue)
    writers = await fetchval(queue, "SELECT count(DISTINCT shard) FROM {s}.history_counts")
    assert writers >= 2, "three workers' completers all counted into one shard"

    # retry_failed moves failed rows back to queued (in jobs; history is untouched).
    assert await queue.retry_failed(queue="a") == 10
    await assert_exact(queue)

    # Pruning deletes from history: counted down by the delete trigger, in the pruner's shard.
    await execute(queue, "UPDATE {s}.jobs_history SET finished_at = now() - interval '2 days'"
                  " WHERE queue = 'a' AND mod(id, 2) = 0")
    expired = await fetchval(queue, "SELECT count(*) FROM {s}.jobs_history"
                             " WHERE finished_at < now() - interval '1 day'")
    assert expired > 50
    assert await queue.prune(older_than=timedelta(days=1)) == {"a": expired}
    await assert_exact(queue)

    # The leader's fold: one row per (queue, status), same sums.
    await Pruner(queue.database, Retention(None), interval=60).turn()
    assert await fetchval(queue, "SELECT count(*) FILTER (WHERE shard <> 0)"
                          " FROM {s}.history_counts") == 0
    await assert_exact(queue)

    # A queue whose history is all gone leaves nothing behind once folded.
    await execute(queue, "UPDATE {s}.jobs_history SET finished_at = now() - interval '2 days'"
                  " WHERE queue = 'b'")
    await queue.prune(older_than=timedelta(days=1))
    await Pruner(queue.database, Retention(None), interval=60).turn()
    assert await fetchval(queue, "SELECT count(*) FROM {s}.history_counts WHERE queue = 'b'") == 0
    await assert_exact(queue)
    assert (await queue.stats())["b"]["cancelled"] == 0


async def test_counts_stay_exact_through_an_operators_update_and_truncate(queue: Queue) -> None:
    ids = await queue.enqueue_many("t", [{}] * 6, queue="a")
    for i in ids[:4]:
        assert await queue.cancel(i)
    await execute(queue, "UPDATE {s}.jobs_history SET queue = 'moved', status = 'done'"
                  " WHERE id = ANY(%s)", ids[:2])
    await assert_exact(queue)
    assert (await queue.stats())["moved"]["done"] == 2
    await execute(queue, "TRUNCATE {s}.jobs_history")
    await assert_exact(queue)
    assert set(await queue.stats()) == {"a"}


async def test_a_truncate_while_a_fold_is_in_flight_leaves_no_count(
        queue: Queue, pg_dsn: str) -> None:
    """The fold writes a new shard-0 row, uncommitted, while an operator truncates history:
    the truncate waits for it and the row does not survive (a DELETE in the trigger, whose
    snapshot predates the row, left it: stats() counted 3 cancelled jobs that were gone)."""
    for i in await queue.enqueue_many("t", [{}] * 3, queue="a"):
        assert await queue.cancel(i)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as fold, \
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as operator:
        await fold.execute(queue.database.sql.history_counts_fold)
        truncate = asyncio.create_task(operator.execute(
            sql.SQL("TRUNCATE {s}.jobs_history").format(s=sql.Identifier(queue.schema))))

        async def truncate_waits() -> bool:
            return bool(await fetchval(queue, "SELECT count(*) FROM pg_stat_activity"
                                       " WHERE datname = current_database()"
                                       " AND wait_event_type = 'Lock' AND query LIKE %s",
                                       "TRUNCATE %"))

        await wait_for(truncate_waits, timeout=10, what="the TRUNCATE waiting for the fold")
        await fold.commit()
        await asyncio.wait_for(truncate, 10)
    await assert_exact(queue)
    assert await queue.stats() == {}


async def test_folds_beside_writers_stay_exact_and_never_deadlock(queue: Queue) -> None:
    # Writers on their own connections (their own shards), each statement writing two queues,
    # listed in the opposite order of the counts' key, while the fold runs in a loop.
    insert = sql.SQL(counted(
        "INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at,"
        " attempts, max_attempts, created_at, finished_at)"
        " SELECT %s * 1000000 + %s * 10 + g, (ARRAY['zz', 'aa'])[g], 't', '{{}}', 'done', 0,"
        " now(), 1, 3, now(), now() FROM generate_series(1, 2) g")).format(
            s=sql.Identifier(queue.schema))
    delete = sql.SQL("DELETE FROM {s}.jobs_history WHERE id = ANY(%s)").format(
        s=sql.Identifier(queue.schema))
    stop = asyncio.Event()

    async def writer(w: int) -> None:
        async with queue.connection() as conn:
            for i in range(60):
                await conn.execute(insert, (w + 1, i))
                if i % 3 == 0:
                    await conn.execute(delete, ([(w + 1) * 1000000 + i * 10 + 1],))

    async def folder() -> int:
        folds = 0
        pruner = Pruner(queue.database, Retention(None), interval=60)
        while not stop.is_set():
            await pruner.turn()
            folds += 1
            await asyncio.sleep(0)
        return folds

    fold = asyncio.create_task(folder())
    await asyncio.gather(*(writer(w) for w in range(6)))
    stop.set()
    assert await fold > 0
    await assert_exact(queue)
    assert (await queue.stats())["zz"]["done"] == 6 * 40


# --- the migration -----------------------------------------------------------------------------


async def test_upgrade_backfills_an_existing_history(pg_dsn: str, schema: str) -> None:
    async with old_schema(pg_dsn, schema) as q:
        await execute(q, fill_history(5_000, count=False))
        async with q.connection() as conn:  # by hand: an enqueue now needs version 13
            cur = await conn.execute(sql.SQL(
                "INSERT INTO {s}.jobs (task, payload, queue) SELECT 't', '{{}}', 'b'"
                " FROM generate_series(1, 4) ORDER BY 1 RETURNING id").format(
                    s=sql.Identifier(schema)))
            live = sorted(int(r[0]) for r in await cur.fetchall())
        async with q.connection() as conn:  # the cancel of version 2: no trigger then
            await conn.execute(sql.SQL(
                "WITH cancelled AS ("
                " DELETE FROM {s}.jobs WHERE id = %s AND status = 'queued' RETURNING *)"
                " INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority,"
                "   run_at, attempts, max_attempts, dedup_key, locked_by, last_error,"
                "   created_at, finished_at)"
                " SELECT id, queue, task, payload, 'cancelled', priority, run_at, attempts,"
                "   max_attempts, dedup_key, locked_by, last_error, created_at, now()"
                " FROM cancelled").format(s=sql.Identifier(schema)), (live[0],))
        before = await true_counts(q)
        assert await q.install() == LATER_THAN_2
        assert await fetchval(q, "SELECT count(*) FROM {s}.history_counts WHERE shard <> 0") == 0
        assert await q.stats() == before
        indexes = await fetchval(q, "SELECT array_agg(indexname::text) FROM pg_indexes"
                                 " WHERE schemaname = %s AND tablename = 'jobs_history'", schema)
        # 0003 dropped the (queue, status) index; 0008 adds the dashboard's browse indexes.
        assert sorted(indexes) == ["jobs_history_finished_brin", "jobs_history_pkey",
                                   "jobs_history_queue_browse_idx",
                                   "jobs_history_task_browse_idx"]
        assert "autosummarize=on" in await fetchval(
            q, "SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
            f"{schema}.jobs_history_finished_brin")
        assert await q.cancel(live[1])
        await assert_exact(q)
        assert (await q.stats())["b"]["cancelled"] == before["b"]["cancelled"] + 1


async def test_upgrade_beside_writers_counts_each_row_once(pg_dsn: str, schema: str) -> None:
    """The backfill waits for a writer in the middle of its transaction, and a writer that
    comes after waits for the backfill's commit, then runs its (already prepared) statement
    with the triggers: neither row is missed or counted twice."""
    # Up to version 9: from version 10 on, inserts count themselves, and no trigger counts
    # a plain INSERT (0010_history_counted.sql).
    until_9 = [m for m in migrations.available() if m.version <= 9]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(migrations, "available", lambda: until_9)
        await _upgrade_beside_writers(pg_dsn, schema)


async def _upgrade_beside_writers(pg_dsn: str, schema: str) -> None:
    insert = sql.SQL(
        "INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at,"
        " attempts, max_attempts, created_at, finished_at)"
        " VALUES (%s, %s, 't', '{{}}', 'done', 0, now(), 1, 3, now(), now())").format(
            s=sql.Identifier(schema))
    async with old_schema(pg_dsn, schema) as q:
        await execute(q, fill_history(1_000, count=False))
        first = await psycopg.AsyncConnection.connect(pg_dsn)  # not autocommit
        late = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        try:
            for i in range(1, 6):  # prepared server-side before the upgrade
                await late.execute(insert, (i, "late"), prepare=True)
            await first.execute(insert, (100, "first"))  # and its transaction stays open
            install = asyncio.create_task(q.install())
            await wait_for(lambda: waiting_on_history(q, 1), what="the backfill to wait")
            blocked = asyncio.create_task(late.execute(insert, (6, "late"), prepare=True))
            await wait_for(lambda: waiting_on_history(q, 2), what="the late writer to wait")
            await first.commit()
            assert await asyncio.wait_for(install, 30) == list(range(3, 10))
            await asyncio.wait_for(blocked, 30)
            await late.execute(insert, (7, "late"), prepare=True)
        finally:
            await first.close()
            await late.close()
        await assert_exact(q)
        stats = await q.stats()
        assert (stats["first"]["done"], stats["late"]["done"]) == (1, 7)


async def waiting_on_history(q: Queue, n: int) -> bool:
    return bool(await fetchval(
        q, "SELECT count(*) FROM pg_locks WHERE NOT granted"
           " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
           " AND relation = %s::regclass",
        f"{q.schema}.jobs_history") == n)


@pytest.mark.processes
def test_cli_status_counts_history_from_the_counts(pg_dsn: str, schema: str) -> None:
    async def setup() -> dict[str, dict[str, int]]:
        q = Queue(pg_dsn, schema=schema)
        async with q:
            await q.install()
            await execute(q, fill_history(2_000))
            await execute(q, "DELETE FROM {s}.jobs_history WHERE mod(id, 7) = 0")
            return await true_counts(q)

    expected = asyncio.run(setup())
    r = run_cli("status", "--json", "--schema", schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["queues"] == expected


async def test_a_backend_counts_into_a_shard_that_moves_on_every_second(queue: Queue) -> None:
    """Under a pinned xmin horizon every old version of a counts row stays, and the upsert of
    its key reads them all: the shard a backend writes moves on each second, so that no row
    takes all of one backend's statements; two backends keep their distance (no new lock
    waits between them)."""
    from asyncjobq._db.sql.common import HISTORY_SHARD

    async with queue.connection() as a, queue.connection() as b:
        async def shards() -> tuple[int, int, int]:
            # One statement per connection, each in its own transaction (its own now()).
            x = await (await a.execute(
                f"SELECT {HISTORY_SHARD}, pg_backend_pid(), extract(epoch FROM now())::bigint"
            )).fetchone()
            y = await (await b.execute(f"SELECT {HISTORY_SHARD}, pg_backend_pid()")).fetchone()
            assert x is not None and y is not None
            await a.commit()
            await b.commit()
            assert 1 <= x[0] <= 64
            return x[0], (y[0] - x[0]) % 64, x[2]

        first, apart, at = await shards()
        seen: list[tuple[int, int, int]] = []

        async def moved() -> bool:
            seen.append(await shards())
            return seen[-1][2] != at

        await wait_for(moved, 5, what="a statement a second later")
        later, apart_later, at_later = seen[-1]
        assert later == 1 + (first - 1 + at_later - at) % 64
        # Mostly the same distance: b's statement may have fallen in the next second.
        assert apart_later in (apart, (apart + 1) % 64, (apart - 1) % 64)
