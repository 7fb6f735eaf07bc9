"""The app that test worker processes run: handlers log every execution to <schema>.claims."""

from __future__ import annotations

import logging
import os
import time

import anyio
import psycopg
from psycopg import sql

from asyncjobq import Job, Queue

queue = Queue(schema=os.environ.get("ASYNCJOBQ_TEST_SCHEMA", "asyncjobq"))


async def log_execution(job: Job) -> None:
    async with queue.connection() as conn:
        await conn.execute(
            sql.SQL("INSERT INTO {}.claims (job_id, attempt, pid, worker) VALUES (%s, %s, %s, %s)")
            .format(sql.Identifier(queue.schema)), (job.id, job.attempt, os.getpid(), job.worker))


@queue.task(name="log")
async def log_job(job: Job) -> None:
    await log_execution(job)


@queue.task(name="sleep", max_attempts=5)
async def sleep_job(job: Job) -> None:
    """Sleeps payload["seconds"]; payload["by_attempt"] = [s1, s2, ...] overrides per attempt."""
    await log_execution(job)
    await anyio.sleep(_seconds(job))


def _seconds(job: Job) -> float:
    by_attempt = job.payload.get("by_attempt")
    if by_attempt:
        return float(by_attempt[min(job.attempt, len(by_attempt)) - 1])
    return float(job.payload.get("seconds", 1))


@queue.task(name="block", max_attempts=5)
async def block_job(job: Job) -> None:
    """Blocks the event loop payload["seconds"]; payload["by_attempt"] as in sleep_job."""
    await log_execution(job)
    time.sleep(_seconds(job))  # noqa: ASYNC251 - blocks the loop on purpose


@queue.task(name="block_sync", max_attempts=5)
def block_sync_job(job: Job) -> None:
    """A plain `def` handler: logs its execution, then sleeps in its thread."""
    with psycopg.connect(queue.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {}.claims (job_id, attempt, pid, worker) VALUES (%s, %s, %s, %s)")
            .format(sql.Identifier(queue.schema)), (job.id, job.attempt, os.getpid(), job.worker))
    time.sleep(float(job.payload.get("seconds", 1)))


@queue.task(name="say")
def say_job(job: Job) -> None:
    """A plain `def` handler that logs a line of its own: asyncjobq.logs names its job."""
    logging.getLogger("testapp").warning("saying %s", job.payload.get("word", "hi"))
