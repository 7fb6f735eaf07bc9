"""Pooler mode (Queue(pooler=...), docs/guides/deploying.md#behind-pgbouncer) in process, on
the test server: what it turns off and what replaces it. tests/test_deploy.py runs the same
through a real PgBouncer."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import psycopg.errors
import pytest
from conftest import fetchval, running
from psycopg.conninfo import make_conninfo

from asyncjobq import ConfigurationError, Job, Queue, Worker
from asyncjobq.errors import reason


async def test_pooler_setting_is_checked() -> None:
    with pytest.raises(ConfigurationError, match=r"pooler='pgbouncer'.*'transaction'"):
        Queue(pooler="pgbouncer")
    with pytest.raises(ConfigurationError, match="malformed"):
        Queue(listen_dsn="postgresql://host:notaport/db")
    q = Queue(pooler="transaction", listen_dsn="postgresql://db/app")
    assert q.database.pooled and q.database.listen_dsn == "postgresql://db/app"
    q.set_pooler("none")
    assert not q.database.pooled


async def test_a_direct_connection_is_not_taken_for_a_pooler(queue: Queue) -> None:
    assert queue.database.pooler == "auto" and not queue.database.pooled
    assert queue.database.listen_dsn == queue.dsn
    with pytest.raises(ConfigurationError, match="close it first"):
        queue.set_pooler("transaction")


def test_a_statement_prepared_elsewhere_names_the_fix() -> None:
    e = psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_0" does not exist')
    assert "pooler='transaction'" in reason(e)
    assert "pooler" not in reason(psycopg.errors.UndefinedTable("relation x does not exist"))


async def test_pooler_mode_runs_and_waits_without_listen_or_session_state(
        pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    """pooler="transaction" without listen_dsn: no LISTEN connection, no prepared statement,
    no session setting; the worker polls and says so, waits read their jobs, and heartbeats
    (SET LOCAL in a transaction) keep a job longer than its lease."""
    q = Queue(pg_dsn, schema=schema, pooler="transaction", application_name="pooled")

    @q.task()
    async def slow(job: Job) -> int:
        await asyncio.sleep(float(job.payload["seconds"]))
        return 0

    async with q:
        await q.install()
        with caplog.at_level(logging.INFO):
            async with running(Worker(q, concurrency=4, lease=3, poll_interval=0.2)) as w:
                job_id = await slow.enqueue({"seconds": 5})
                assert await q.result(job_id, timeout=30) == 0
                assert w.heartbeat is not None and w.heartbeat.beats >= 2
                names = await fetchval(
                    q, "SELECT array_agg(DISTINCT application_name) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name LIKE 'pooled%%'")
        info = await q.get(job_id)
        assert info is not None and info.attempts == 1  # never reaped
        # Every pooled connection: a statement run past psycopg's threshold (5) is still
        # not prepared.
        assert q.database.pool.kwargs["prepare_threshold"] is None
        async with q.connection() as conn:
            for _ in range(8):
                await q.enqueue(slow, {"seconds": 0}, conn=conn)
            prepared = await (await conn.execute(
                "SELECT count(*) FROM pg_prepared_statements")).fetchone()
        assert prepared == (0,)
    assert not any(n.endswith(("-listen", "-wait")) for n in names), names
    assert "polling every 0.2 s" in caplog.text
    assert "leaves the vacuum" in caplog.text


async def test_listen_dsn_must_reach_the_same_database(pg_dsn: str, schema: str) -> None:
    other = make_conninfo(pg_dsn, dbname="template1")
    q = Queue(pg_dsn, schema=schema, listen_dsn=other)
    with pytest.raises(ConfigurationError, match="reaches database 'template1'"):
        await q.open()
    assert not q.database.is_open
    q = Queue(pg_dsn, schema=schema, listen_dsn=pg_dsn)
    async with q:
        assert q.database.listen_dsn == pg_dsn
    # Given for one database, forgotten when the queue is pointed at another.
    with q.bound_to(other, "elsewhere"):
        assert q.database.listen_dsn == q.dsn == other
    assert q.database.listen_dsn == pg_dsn
    q.set_dsn(other)
    assert q.database.listen_dsn == other
