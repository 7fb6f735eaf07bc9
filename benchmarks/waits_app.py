"""The app of benchmarks/waits.py's worker process: a task whose result is when it returned."""

from __future__ import annotations

import os
import time

from asyncjobq import Job, Queue

queue = Queue(os.environ["ASYNCJOBQ_DSN"], schema="bench_waits")


@queue.task(name="stamp")
async def stamp(job: Job) -> dict[str, float]:
    return {"t": time.time()}
