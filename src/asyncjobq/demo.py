"""`asyncjobq demo`: the article's example end to end, on the embedded server by default.

The example app: every job sleeps a little; n % 7 == 0 fails its first attempt and succeeds on
the retry (as in the article's n % 7 example), n % 49 == 0 fails every time and ends `failed`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
from psycopg import sql

from . import runtime
from .job import Job
from .queue import Queue

SCHEMA = "asyncjobq_demo"

queue = Queue(schema=SCHEMA)


@queue.task(name="demo.work", max_attempts=3, backoff=lambda attempt: 0.5 * attempt)
async def work(job: Job) -> None:
    n = int(job.payload["n"])
    await anyio.sleep(0.002)
    if n % 49 == 0:
        raise RuntimeError(f"n={n} is a multiple of 49: fails every attempt")
    if n % 7 == 0 and job.attempt == 1:
        raise RuntimeError(f"n={n} is a multiple of 7: fails its first attempt")


async def _prepare(dsn: str, jobs: int) -> None:
    async with Queue(dsn, schema=SCHEMA) as q:
        async with q.connection() as conn:
            await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(SCHEMA)))
        await q.install()
        await q.enqueue_many("demo.work", [{"n": n} for n in range(1, jobs + 1)])


async def _counts(dsn: str) -> dict[str, int]:
    async with Queue(dsn, schema=SCHEMA, pool_min_size=1, pool_max_size=1) as q:
        stats = await q.stats()
    total: dict[str, int] = {}
    for per_status in stats.values():
        for k, v in per_status.items():
            total[k] = total.get(k, 0) + v
    return total


async def _attempt_histogram(dsn: str) -> list[tuple[str, int, int]]:
    async with Queue(dsn, schema=SCHEMA) as q, q.connection() as conn:
        cur = await conn.execute(sql.SQL(
            "SELECT status::text, attempts, count(*) FROM ("
            " SELECT status, attempts FROM {s}.jobs"
            " UNION ALL SELECT status, attempts FROM {s}.jobs_history) t"
            " GROUP BY 1, 2 ORDER BY 1, 2").format(s=sql.Identifier(SCHEMA)))
        return [(str(s), int(a), int(n)) for s, a, n in await cur.fetchall()]


def run_demo(dsn: str | None, *, jobs: int, workers: int) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=False)
    resolved = queue.dsn if dsn is None else dsn
    console.print(f"[bold]asyncjobq demo[/]: {jobs} jobs, {workers} worker process(es), "
                  f"schema {SCHEMA}")
    runtime.run(_prepare, resolved, jobs)
    env = dict(os.environ, ASYNCJOBQ_DSN=resolved)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "asyncjobq", "worker", "asyncjobq.demo:queue",
             "--concurrency", "50", "--batch", "50", "--log-level", "error",
             "--name", f"demo-{i + 1}"],
            env=env)
        for i in range(workers)
    ]
    started = time.monotonic()
    counts: dict[str, int] = {}
    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("running jobs", total=jobs)
            while True:
                counts = runtime.run(_counts, resolved)
                finished = counts.get("done", 0) + counts.get("failed", 0)
                progress.update(bar, completed=finished, description=(
                    f"done {counts.get('done', 0)} · failed {counts.get('failed', 0)} · "
                    f"running {counts.get('running', 0)}"))
                if finished >= jobs:
                    break
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    raise SystemExit(f"asyncjobq: error: demo worker exited with code "
                                     f"{dead[0].returncode}; see the messages above")
                time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    elapsed = time.monotonic() - started
    table = Table(title="outcomes")
    for col in ("status", "attempts", "jobs"):
        table.add_column(col, justify="right")
    rows: list[Any] = runtime.run(_attempt_histogram, resolved)
    for status, attempts, n in rows:
        table.add_row(status, str(attempts), str(n))
    console.print(table)
    console.print(
        f"{counts.get('done', 0)} done, {counts.get('failed', 0)} failed (dead-lettered, see "
        f"`asyncjobq status --schema {SCHEMA}`) in {elapsed:.1f} s "
        f"({jobs / elapsed:.0f} jobs/s with retries' backoff included)")
