"""The app of benchmarks/workflows.py's worker processes."""

from __future__ import annotations

import os
import time

from psycopg import sql

from asyncjobq import Job, Queue

queue = Queue(os.environ["ASYNCJOBQ_DSN"], schema="bench_workflows")


@queue.task(name="part")
async def part(job: Job) -> int:
    return int(job.payload["i"])


@queue.task(name="gather")
async def gather(job: Job) -> int:
    """The fan-in's child: logs each run (the figure is how many runs per child)."""
    async with queue.connection() as conn:
        await conn.execute(sql.SQL("INSERT INTO {}.runs (job_id) VALUES (%s)")
                           .format(sql.Identifier(queue.schema)), (job.id,))
    return sum(job.parent_results.values())


@queue.task(name="link")
async def link(job: Job) -> dict[str, float]:
    """A chain's step: when it started (this clock), and that its parent had started first."""
    started = time.time()
    before = [r["started"] for r in job.parent_results.values()]
    return {"started": started, "n": int(job.payload["n"]),
            "after_parent": all(b <= started for b in before)}
