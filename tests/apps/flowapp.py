"""The app of the flow-control tests' worker processes (tests/test_limits.py): each handler
appends "task key seq start end pid" to $FLOW_LOG (one line per job, O_APPEND), times from
time.time(), which every process of the machine shares."""

from __future__ import annotations

import os
import time

import anyio

from asyncjobq import Job, Queue

queue = Queue(schema=os.environ.get("ASYNCJOBQ_TEST_SCHEMA", "asyncjobq"))


async def _record(job: Job, key: str) -> None:
    started = time.time()
    sleep = job.payload.get("then", job.payload.get("sleep", 0.01)) if job.attempt > 1 \
        else job.payload.get("sleep", 0.01)
    await anyio.sleep(float(sleep))
    line = (f"{job.task} {key} {job.payload.get('seq', 0)} {started:.6f} {time.time():.6f} "
            f"{os.getpid()}\n")
    fd = os.open(os.environ["FLOW_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@queue.task(name="limited", concurrency_limit=3)
async def limited(job: Job) -> None:
    await _record(job, "-")


@queue.task(name="keyed", key_limit=1)
async def keyed(job: Job) -> None:
    await _record(job, str(job.payload.get("key", "-")))


@queue.task(name="rated", rate_limit="50/s")
async def rated(job: Job) -> None:
    await _record(job, "-")
