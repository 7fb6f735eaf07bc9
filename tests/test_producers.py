"""Producers through a database outage (issue 25): enqueue works again within about a second of
PostgreSQL's return, and a connection lost under an enqueue fails in asyncjobq's words, saying
whether the job may have been written."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg
import pytest
from conftest import execute, fetchval, wait_for
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from asyncjobq import (
    ConfigurationError,
    DatabaseUnavailableError,
    EnqueueConnectionError,
    EnqueueRefusedError,
    Queue,
)


def stop_server(server: Any) -> None:
    from pgserver._commands import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user,
           timeout=60)


def start_server(server: Any) -> None:
    """Start it again as pgserver does: no TCP, the same socket directory and log."""
    from pgserver._commands import pg_ctl

    socket_dir = conninfo_to_dict(server.get_uri())["host"]
    pg_ctl(["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(server.log), "start"],
           pgdata=server.pgdata, user=server.system_user, timeout=60)


async def first_accepted(dsn: str) -> float:
    """When the server accepts connections again: the start of the first connect that works
    (a connect to a server not yet up fails at once, so this is at most a few ms late)."""
    while True:
        t0 = time.monotonic()
        try:
            conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=2)
        except psycopg.OperationalError:
            await asyncio.sleep(0.005)
            continue
        await conn.close()
        return t0


class Load:
    """A steady stream of enqueues, each call its own task, one started every `every` s."""

    def __init__(self, call: Callable[[int], Awaitable[Any]], every: float = 0.01) -> None:
        self.call = call
        self.every = every
        self.ok: list[tuple[float, Any]] = []  # (monotonic time it returned, its result)
        self.failed: list[BaseException] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _one(self, n: int) -> None:
        try:
            result = await self.call(n)
        except Exception as e:
            self.failed.append(e)
        else:
            self.ok.append((time.monotonic(), result))

    async def _run(self) -> None:
        calls: set[asyncio.Task[None]] = set()
        n = 0
        while not self._stop.is_set():
            t = asyncio.create_task(self._one(n))
            calls.add(t)
            t.add_done_callback(calls.discard)
            n += 1
            await asyncio.sleep(self.every)  # the load's rate, not a wait for a condition
        await asyncio.gather(*calls)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, timeout=60)


@pytest.mark.timeout(180)
@pytest.mark.processes
async def test_enqueue_resumes_within_a_second_of_the_server_return(private_server: Any,
                                                                    schema: str) -> None:
    """A 4 s outage under a steady load: the pool's default backoff (attempts at +0, +1, +3,
    +7 s...) first reconnected ~3 s after the server was back; bounded, ~0.5 s at most."""
    dsn = private_server.get_uri()
    async with Queue(dsn, schema=schema) as q:
        await q.install()
        load = Load(lambda n: q.enqueue("t", {"n": n}))
        load.start()
        try:
            await wait_for(lambda: len(load.ok) >= 50, what="enqueues before the outage")
            await anyio.to_thread.run_sync(stop_server, private_server)
            await asyncio.sleep(4.0)  # the outage's length
            back = asyncio.create_task(first_accepted(dsn))
            await anyio.to_thread.run_sync(start_server, private_server)
            t_back = await asyncio.wait_for(back, timeout=30)
            await wait_for(lambda: any(t > t_back for t, _ in load.ok), timeout=60,
                           what="an enqueue committed after the restart")
        finally:
            await load.stop()
        gap = min(t for t, _ in load.ok if t > t_back) - t_back
        print(f"\nfirst committed enqueue {gap:.3f} s after the server accepted connections "
              f"again ({len(load.ok)} enqueued, {len(load.failed)} failed)")
        assert gap <= 1.5
        # What failed did so in our words (the calls in flight when the server stopped).
        assert all(isinstance(e, DatabaseUnavailableError) for e in load.failed), {
            type(e).__name__: str(e) for e in load.failed}
        ids = [i for _, i in load.ok]
        assert len(set(ids)) == len(ids)


async def terminate(pg_dsn: str, app: str) -> int:
    """End the backends of connections named `app`; how many there were."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                                 " WHERE datname = current_database()"
                                 " AND application_name = %s", (app,))
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def backends_gone(pg_dsn: str, app: str) -> bool:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s", (app,))
        row = await cur.fetchone()
        return row is not None and row[0] == 0


@pytest.mark.timeout(120)
async def test_connections_terminated_under_enqueues(pg_dsn: str, schema: str) -> None:
    """pg_terminate_backend on the pool's connections, every 30 ms, through a stream of
    enqueue (coalesced and with a dedup_key) and enqueue_many: every call returns ids that
    exist, or raises EnqueueConnectionError; no id comes back twice. Before: AdminShutdown
    reached the callers."""
    app = f"aq-{schema}"
    async with Queue(pg_dsn, schema=schema, application_name=app) as q:
        await q.install()

        async def call(n: int) -> tuple[str | None, list[int]]:
            if n % 3 == 0:
                return None, [await q.enqueue("t", {"n": n})]
            if n % 3 == 1:
                key = f"k{n}"
                return key, [await q.enqueue("t", {"n": n}, dedup_key=key)]
            return None, await q.enqueue_many("t", [{"n": n, "i": i} for i in range(3)])

        load = Load(call, every=0.002)
        load.start()
        kills = 0
        try:
            for _ in range(100):
                await asyncio.sleep(0.03)  # the fault's cadence, not a wait for a condition
                kills += await terminate(pg_dsn, app)
        finally:
            await load.stop()
        maybe = Counter(e.may_have_been_written for e in load.failed
                        if isinstance(e, EnqueueConnectionError))
        print(f"\n{len(load.ok)} calls returned, {len(load.failed)} failed "
              f"(may have been written: {maybe[True]}, not written: {maybe[False]}); "
              f"{kills} backends terminated")
        assert kills > 0 and len(load.ok) > 100
        assert all(isinstance(e, EnqueueConnectionError) for e in load.failed), Counter(
            f"{type(e).__name__}: {e}" for e in load.failed)
        for e in load.failed:
            assert isinstance(e, EnqueueConnectionError)
            if e.may_have_been_written:
                assert "may or may not have been written" in str(e) and "dedup_key" in str(e)
        ids = [i for _, (_, batch) in load.ok for i in batch]
        assert len(ids) == len(set(ids)), "an id was returned twice"
        # Read through a queue of its own: the last kill may have ended a pooled connection
        # whose FATAL message has not reached the client yet.
        async with Queue(pg_dsn, schema=schema) as truth:
            assert await fetchval(truth, "SELECT count(*) FROM {s}.jobs WHERE id = ANY(%s)",
                                  ids) == len(ids)
            for _, (key, batch) in load.ok:
                if key is not None:  # a dedup_key sent again returned the one job of that key
                    assert await fetchval(truth, "SELECT array_agg(id) FROM {s}.jobs "
                                          "WHERE dedup_key = %s", key) == batch


@pytest.mark.timeout(60)
async def test_dead_idle_connections_are_replaced_without_an_error(pg_dsn: str,
                                                                   schema: str) -> None:
    """A failure before the INSERT is sent cannot duplicate: a pool whose idle connections were
    all ended (a restart while the service was idle) serves the next enqueues at once. Before:
    the pool's check paused 1 s, then 2 s, 4 s... between its dead connections (7 s here)."""
    app = f"aq-{schema}"
    async with Queue(pg_dsn, schema=schema, application_name=app, pool_min_size=4) as q:
        await q.install()
        await wait_for(lambda: q.pool.get_stats().get("pool_available") == 4,
                       what="4 idle pooled connections")
        assert await terminate(pg_dsn, app) == 4
        await wait_for(lambda: backends_gone(pg_dsn, app), what="the backends ended")
        t0 = time.monotonic()
        one = await q.enqueue("t", {})
        keyed = await q.enqueue("t", {}, dedup_key="k")
        many = await q.enqueue_many("t", [{}, {}])
        elapsed = time.monotonic() - t0
        assert await fetchval(q, "SELECT count(*) FROM {s}.jobs WHERE id = ANY(%s)",
                              [one, keyed, *many]) == 4
        assert elapsed < 1.0, f"{elapsed:.2f} s"


@pytest.mark.timeout(60)
async def test_callers_connection_lost_in_its_transaction(queue: Queue, pg_dsn: str) -> None:
    """With conn=, nothing is retried: the caller's transaction is lost with its connection,
    and the error says so in our words (before: a raw AdminShutdown)."""
    app = f"aq-caller-{queue.schema}"
    for many in (False, True):
        async with await psycopg.AsyncConnection.connect(pg_dsn, application_name=app) as c:
            await c.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(
                sql.Identifier(queue.schema)))  # a transaction is open
            assert await terminate(pg_dsn, app) == 1
            await wait_for(lambda: backends_gone(pg_dsn, app), what="the backend ended")
            with pytest.raises(EnqueueConnectionError, match="its transaction is lost") as e:
                if many:
                    await queue.enqueue_many("t", [{}, {}], conn=c)
                else:
                    await queue.enqueue("t", {}, conn=c)
            assert e.value.may_have_been_written is False
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 0


# --- what the server refuses, and the producer's own mistakes ------------------------------------


def with_options(dsn: str, options: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, options=options)


async def test_a_read_only_server_refuses_every_enqueue_in_our_words(pg_dsn: str,
                                                                     schema: str) -> None:
    """After a failover the DSN may reach a standby: each kind of enqueue says so and what to
    do (before: a raw ReadOnlySqlTransaction, the dedup one saying "cannot execute SELECT")."""
    async with Queue(pg_dsn, schema=schema) as q:
        await q.install()
    async with Queue(with_options(pg_dsn, "-c default_transaction_read_only=on"),
                     schema=schema) as q:
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: q.enqueue("t", {}),
            lambda: q.enqueue("t", {}, dedup_key="k"),
            lambda: q.enqueue_many("t", [{}, {}]),
        ]
        for call in calls:
            with pytest.raises(EnqueueRefusedError) as e:
                await call()
            assert e.value.sqlstate == "25006"
            assert "nothing was written" in str(e.value)
            assert "point the DSN at the new primary" in str(e.value)
            assert isinstance(e.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        async with q.connection() as c, c.transaction():
            with pytest.raises(EnqueueRefusedError, match="roll it back"):
                await q.enqueue("t", {}, conn=c)
            raise psycopg.Rollback()


async def test_one_bad_row_in_a_coalesced_batch_fails_only_its_caller(queue: Queue) -> None:
    """The inserter's row-by-row retry still tells rows apart under the refused error."""
    await execute(queue, "ALTER TABLE {s}.jobs ADD CONSTRAINT no_bad"
                         " CHECK (payload->>'bad' IS NULL)")
    results = await asyncio.gather(
        *(queue.enqueue("t", {"bad": 1} if i == 7 else {"i": i}) for i in range(40)),
        return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], EnqueueRefusedError), errors
    assert errors[0].sqlstate == "23514" and isinstance(results[7], EnqueueRefusedError)
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 39


async def test_a_statement_timeout_on_a_locked_table_is_refused_in_our_words(
        pg_dsn: str, schema: str) -> None:
    async with Queue(pg_dsn, schema=schema) as q:
        await q.install()
        async with await psycopg.AsyncConnection.connect(pg_dsn) as locker:
            await locker.execute(sql.SQL("LOCK TABLE {}.jobs").format(sql.Identifier(schema)))
            async with Queue(with_options(pg_dsn, "-c statement_timeout=200"),
                             schema=schema) as short:
                with pytest.raises(EnqueueRefusedError, match="statement_timeout") as e:
                    await short.enqueue("t", {})
                assert e.value.sqlstate == "57014"


async def test_a_pool_held_by_the_caller_says_so(pg_dsn: str, schema: str) -> None:
    """An enqueue without conn= while the caller holds the only pooled connection: the error
    names the pool and conn=, not only a server that may be down."""
    async with Queue(pg_dsn, schema=schema, pool_max_size=1, connect_timeout=0.5) as q:
        await q.install()
        async with q.connection():
            with pytest.raises(EnqueueConnectionError) as e:
                await q.enqueue("t", {})
        assert e.value.may_have_been_written is False
        assert "pool_max_size" in str(e.value) and "conn=" in str(e.value)
        assert await q.enqueue("t", {}) > 0  # and a fraction of a second opened the pool


@pytest.mark.parametrize("bad", [0, -1, "5", None, float("nan"), True])
def test_a_bad_connect_timeout_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"connect_timeout=.*: use a number of seconds"):
        Queue("postgresql://unused", connect_timeout=bad)  # type: ignore[arg-type]


async def test_pooled_connections_detect_a_server_that_vanished(queue: Queue) -> None:
    """A server gone without closing the socket must end the connection in seconds, not after
    the kernel's ~15 min retransmission timeout: keepalives and tcp_user_timeout are set."""
    async with queue.connection() as conn:
        params = conn.pgconn.info
    given = {p.keyword.decode(): (p.val or b"").decode() for p in params}
    assert given["keepalives"] == "1"
    assert int(given["tcp_user_timeout"]) > 0
    assert int(given["keepalives_idle"]) > 0


async def test_on_enqueued_is_not_told_of_a_dedup_key_that_matched(queue: Queue) -> None:
    seen: list[list[int]] = []

    class Hook:
        async def on_enqueued(self, job_ids: list[int], task: str, queue: str) -> None:
            seen.append(job_ids)

    queue.add_hook(Hook())
    first = await queue.enqueue("t", {}, dedup_key="k")
    assert await queue.enqueue("t", {}, dedup_key="k") == first
    plain = await queue.enqueue("t", {})
    await wait_for(lambda: [plain] in seen, timeout=5, what="the plain enqueue's hook")
    assert sorted(seen) == [[first], [plain]]


async def test_names_of_a_str_subclass_are_written_as_given(queue: Queue) -> None:
    """The inserter's row encodes names through a cache of exact strs (queue.py, _json_name):
    a str subclass, hashable or not, is encoded as itself, never as a cached name."""

    class Unhashable(str):
        __hash__ = None  # type: ignore[assignment]

    class LooksLikeDefault(str):
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("default")

    await queue.enqueue("t", {}, queue="default")  # "default" is cached now
    first = await queue.enqueue("t", {}, queue=Unhashable("other"))
    second = await queue.enqueue("t", {}, queue=LooksLikeDefault("elsewhere"))
    assert [(await queue.get(i)).queue for i in (first, second)] == [  # type: ignore[union-attr]
        "other", "elsewhere"]
