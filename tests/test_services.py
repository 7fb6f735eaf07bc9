"""The maintenance runner (services.py): a turn that hangs is cut at its timeout, one that
raises anything (even a CancelledError of its own) is logged, and the other services go on."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest
from conftest import execute, wait_for
from psycopg import sql

from asyncjobq import Queue
from asyncjobq._maintenance.reaper import Reaper
from asyncjobq._maintenance.services import Service, ServiceRunner


class Counting(Service):
    def __init__(self, name: str, fail_first: BaseException | None = None,
                 hang_first: bool = False) -> None:
        self.name = name
        self.interval = 0.05
        self.max_backoff = 0.1
        self.timeout = 0.5
        self.turns = 0
        self._fail_first = fail_first
        self._hang_first = hang_first

    async def turn(self) -> None:
        self.turns += 1
        if self.turns == 1 and self._fail_first is not None:
            raise self._fail_first
        if self.turns == 1 and self._hang_first:
            await asyncio.Event().wait()


async def test_a_turn_raising_cancelled_or_hanging_ends_no_service(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    cancelled = Counting("cancels", fail_first=asyncio.CancelledError())
    hanging = Counting("hangs", hang_first=True)
    bystander = Counting("bystander")
    runner = ServiceRunner([cancelled, hanging, bystander])
    task = asyncio.create_task(runner.run())
    try:
        await wait_for(lambda: cancelled.turns >= 3 and hanging.turns >= 3, timeout=10,
                       what="both services turning again")
        assert not task.done()
        assert bystander.turns >= 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "cancels turn failed (CancelledError" in caplog.text
    assert "hangs turn failed (the turn took more than 0.5 s and was cancelled)" in caplog.text


async def test_a_services_own_connection_serves_one_caller_at_a_time(
        queue: Queue, pg_dsn: str) -> None:
    """A reaper turn and a direct reap() share the reaper's connection: one waits for the
    other, and a direct call cancelled meanwhile does not close it under the turn."""
    await execute(queue, "INSERT INTO {s}.jobs (task, payload, status, attempts, locked_by,"
                  " locked_at) SELECT 't', '{{}}', 'running', 1, 'dead',"
                  " now() - interval '1 hour' FROM generate_series(1, 3000)")
    reaper = Reaper(queue.database, lease=30, interval=1)
    async with reaper.own_connection, await psycopg.AsyncConnection.connect(pg_dsn) as blocker, \
            await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as watcher:
        # The turn's UPDATE waits behind this lock, holding the reaper's connection.
        await blocker.execute(sql.SQL("LOCK TABLE {}.jobs IN SHARE MODE").format(
            sql.Identifier(queue.schema)))
        turn = asyncio.create_task(reaper.reap())

        async def turn_blocked() -> bool:
            cur = await watcher.execute("SELECT count(*) FROM pg_stat_activity"
                                        " WHERE datname = current_database() AND"
                                        " wait_event_type = 'Lock' AND application_name"
                                        " LIKE '%%-reaper'")
            row = await cur.fetchone()
            return bool(row and row[0])

        await wait_for(turn_blocked, 10, what="the turn blocked")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reaper.reap(), 0.05)
        await blocker.commit()
        assert await asyncio.wait_for(turn, 10) == 3000
    assert await reaper.reap() == 0


async def test_closing_a_services_connection_waits_for_its_user(queue: Queue) -> None:
    """A worker that stops leading closes its reaper's connection: not under a direct call
    that is using it."""
    reaper = Reaper(queue.database, lease=30, interval=1)
    assert reaper.own_connection is not None
    async with reaper.own_connection:
        async def long_statement() -> object:
            assert reaper.own_connection is not None
            async with reaper.own_connection.connection() as conn:
                started.set()
                cur = await conn.execute("SELECT pg_sleep(0.3), 1")
                return await cur.fetchone()

        started = asyncio.Event()
        user = asyncio.create_task(long_statement())
        await asyncio.wait_for(started.wait(), 10)
        await reaper.own_connection.close()
        assert user.done()
        assert await user == ("", 1)
