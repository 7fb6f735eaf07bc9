"""The app of the deployment drills' workers (tests/test_deploy.py). Handlers write nothing to
the database (which a drill takes away): each appends one line per event to $DEPLOY_LOG
(O_APPEND, one write each), times from time.time(), which every process and namespace of the
machine shares:

    start <task> <job id> <attempt> <pid> <time>
    end <task> <job id> <attempt> <pid> <time>
    cancelled <task> <job id> <attempt> <pid> <time>

A handler sleeps payload["seconds"], its first attempt payload["first"] when given.
"""

from __future__ import annotations

import asyncio
import os
import time

from asyncjobq import Job, Queue

queue = Queue(schema=os.environ.get("ASYNCJOBQ_TEST_SCHEMA", "asyncjobq"))


def record(event: str, job: Job) -> None:
    line = f"{event} {job.task} {job.id} {job.attempt} {os.getpid()} {time.time():.6f}\n"
    fd = os.open(os.environ["DEPLOY_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def _run(job: Job) -> None:
    record("start", job)
    try:
        seconds = job.payload.get("first", 0) if job.attempt == 1 else 0
        await asyncio.sleep(float(seconds or job.payload.get("seconds", 0)))
    except asyncio.CancelledError:
        record("cancelled", job)
        raise
    record("end", job)


@queue.task(name="work", max_attempts=100)
async def work(job: Job) -> None:
    await _run(job)


@queue.task(name="limited", concurrency_limit=3, max_attempts=100)
async def limited(job: Job) -> None:
    await _run(job)


@queue.task(name="tick")
async def tick(job: Job) -> None:
    record("start", job)
    record("end", job)


if os.environ.get("DEPLOY_PERIODIC"):
    queue.periodic(tick, every=1, name="tick-every-second")
