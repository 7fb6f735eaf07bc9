"""Bad input not covered elsewhere: a schema from a newer asyncjobq, a 5 MB payload, odd names
through a real worker, a handler raising KeyboardInterrupt. Real PostgreSQL, no mocks."""

from __future__ import annotations

import pytest
from conftest import execute, run_cli, running, wait_for

import asyncjobq
from asyncjobq import Job, Queue, Worker


@pytest.mark.processes
async def test_schema_from_a_newer_version_is_refused(queue: Queue, pg_dsn: str) -> None:
    await execute(queue, "INSERT INTO {s}.migrations (version, name) VALUES (999, 'future')")
    message = (f"schema {queue.schema} is at version 999, newer than this asyncjobq")
    with pytest.raises(asyncjobq.SchemaVersionError, match=message):
        await Worker(queue).run()
    for args in (["status"], ["status", "--json"], ["install"]):
        r = run_cli(*args, "--schema", queue.schema, dsn=pg_dsn, timeout=30)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stderr.startswith(f"asyncjobq: error: {message}"), r.stderr
        assert "upgrade asyncjobq" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("worker", "apps.testapp:queue", dsn=pg_dsn,
                env={"ASYNCJOBQ_TEST_SCHEMA": queue.schema}, timeout=30)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr


async def test_five_megabyte_payload_runs_and_round_trips(queue: Queue) -> None:
    payload = {"blob": "x" * (5 * 1024 * 1024), "items": list(range(1000))}
    got: list[dict[str, object]] = []

    @queue.task(name="big")
    async def big(job: Job) -> None:
        got.append(job.payload)

    job_id = await big.enqueue(payload)
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: len(got) == 1, what="the 5 MB job")
    assert got == [payload]
    info = await queue.get(job_id)
    assert info is not None and info.payload == payload
    await wait_for(lambda: _status(queue, job_id, "done"), what="done")


async def _status(queue: Queue, job_id: int, status: str) -> bool:
    info = await queue.get(job_id)
    return info is not None and info.status == status


async def test_handler_raising_keyboard_interrupt_fails_the_attempt_only(queue: Queue) -> None:
    @queue.task(name="kbd", max_attempts=1)
    async def kbd(job: Job) -> None:
        raise KeyboardInterrupt

    @queue.task(name="kbd_sync", max_attempts=1)
    def kbd_sync(job: Job) -> None:
        raise KeyboardInterrupt("from a thread")

    @queue.task(name="after")
    async def after(job: Job) -> None:
        pass

    bad = [await kbd.enqueue({}), await kbd_sync.enqueue({})]
    async with running(Worker(queue, poll_interval=0.1)) as w:
        for job_id in bad:
            await wait_for(lambda i=job_id: _status(queue, i, "failed"), what="failed attempt")
        good = await after.enqueue({})  # the worker is still serving
        await wait_for(lambda: _status(queue, good, "done"), what="job after the interrupt")
        assert w.fetcher is not None
    for job_id in bad:
        info = await queue.get(job_id)
        assert info is not None and info.last_error is not None
        assert "KeyboardInterrupt" in info.last_error, info.last_error
