"""Real PostgreSQL for every test (the session's server: ../conftest.py, pg_dsn).

Each test gets its own schema, dropped afterwards. Conditions are awaited with a timeout.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from asyncjobq import Queue, Worker
from asyncjobq._db.sql.common import count_history

TESTS = Path(__file__).parent
ROOT = TESTS.parent


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # Workers of a failed test may still hold connections; end them so DROP cannot hang.
        conn.execute("SET lock_timeout = '5s'")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
async def queue(pg_dsn: str, schema: str) -> AsyncIterator[Queue]:
    q = Queue(pg_dsn, schema=schema, pool_max_size=20)
    async with q:
        await q.install()
        yield q


async def wait_for(cond: Callable[[], Awaitable[bool] | bool], timeout: float = 20.0,
                   interval: float = 0.02, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = cond()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[Worker]:
    """Run a worker in the background for the block, then stop it and wait for it."""
    task = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: worker.fetcher is not None or task.done(), 10, what="worker start")
        if task.done():
            task.result()
        yield worker
    finally:
        worker.stop()
        # The shutdown's own bounded waits (worker.py, _fetch_then_shutdown): the flush in
        # flight and the running handlers (shutdown_timeout each), cancelled ones (5 s), the
        # last outcomes (10 s), hooks (5 s), a lost claim's release (10 s); then resigning.
        # A shutdown slower than that is a hang; one within it, on a loaded machine, is not.
        await asyncio.wait_for(task, timeout=2 * worker.shutdown_timeout + 45)


async def fetchval(q: Queue, query: str, *params: Any) -> Any:
    async with q.connection() as conn:
        cur = await conn.execute(sql.SQL(query).format(s=sql.Identifier(q.schema)), params)
        row = await cur.fetchone()
        return None if row is None else row[0]


async def execute(q: Queue, query: str, *params: Any) -> None:
    async with q.connection() as conn:
        await conn.execute(sql.SQL(query).format(s=sql.Identifier(q.schema)), params)


_current: list[pytest.Item] = []


def counted(insert: str) -> str:
    """`insert` (an INSERT into jobs_history, `{s}` for the schema) counting its rows in
    history_counts as asyncjobq's own writers do (0010_history_counted.sql)."""
    return (f"WITH ins AS ({insert} RETURNING queue, status),"
            f" counted AS ({count_history('ins')}) SELECT count(*) FROM ins")


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[:] = [item]


def _starting_a_process() -> None:
    """Tests that start processes carry the `processes` mark: the tiers of ../conftest.py
    keep them out of the second server's pass and, on a shared server, one at a time."""
    if _current and _current[0].get_closest_marker("processes") is None:
        raise AssertionError(f"{_current[0].nodeid} starts a process: mark it "
                             "@pytest.mark.processes")


class WorkerProcess(subprocess.Popen[str]):
    """A worker process whose stdout and stderr are read as they are written: a worker whose
    pipe is full blocks on its next log line (a storm of lost connections logs far more than a
    pipe holds), and a test that only kills it at the end never reads the pipe."""

    def __init__(self, argv: list[str], **kwargs: Any) -> None:
        _starting_a_process()
        super().__init__(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **kwargs)
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers = [threading.Thread(target=_read_into, args=(stream, sink), daemon=True)
                         for stream, sink in ((self.stdout, self._out),
                                              (self.stderr, self._err))]
        for reader in self._readers:
            reader.start()

    def stderr_so_far(self) -> str:
        return "".join(self._err)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the exit (TimeoutExpired after `timeout`); returns (stdout, stderr)."""
        self.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        return "".join(self._out), "".join(self._err)


def _read_into(stream: Any, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)


def spawn_worker(dsn: str, schema: str, *args: str, app: str = "apps.testapp:queue",
                 env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> WorkerProcess:
    """A worker process started the way users start one: `python -m asyncjobq worker APP`
    (after `prefix`, e.g. what runs it in a network namespace)."""
    full_env = {**os.environ, "ASYNCJOBQ_DSN": dsn, "ASYNCJOBQ_TEST_SCHEMA": schema,
                "PYTHONPATH": str(TESTS), **(env or {})}
    return WorkerProcess(
        [*prefix, sys.executable, "-m", "asyncjobq", "worker", app, "--log-level", "warning",
         *args], cwd=TESTS, env=full_env)


def run_cli(*args: str, dsn: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess[str]:
    _starting_a_process()
    full_env = dict(os.environ, PYTHONPATH=str(TESTS), **(env or {}))
    full_env.pop("ASYNCJOBQ_DSN", None)
    if dsn is not None:
        full_env["ASYNCJOBQ_DSN"] = dsn
    return subprocess.run([sys.executable, "-m", "asyncjobq", *args], cwd=TESTS, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def restart(server: Any, mode: str) -> None:
    from pgserver._commands import pg_ctl

    pg_ctl(["-w", "-m", mode, "restart"], pgdata=server.pgdata, user=server.system_user,
           timeout=60)


def fed_collector(queue: Queue) -> Any:
    """A metrics collector of `queue` fed each kind of event once, so that every family it
    exports has a sample (the metric-name checks of the examples and of the reference page)."""
    from datetime import UTC, datetime

    from asyncjobq import metrics
    from asyncjobq.job import Job

    c = metrics.collector(queue)
    now = datetime.now(UTC)
    job = Job(id=1, task="t", queue="q", payload={}, attempt=1, max_attempts=3, priority=0,
              run_at=now, created_at=now, worker="w")
    c.on_claimed([job])
    c.on_started(job)
    c.on_finished(job, "done", 0.1)
    c.set_depth({"q": {"queued": 1}})
    c.observe_flush(0.01)
    c.observe_reaped([("q", "t", "queued")])
    return c
