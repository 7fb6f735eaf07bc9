"""Workflows (docs/guides/workflows.md), four figures:

1. fan-in: a child of `--parents` (10,000) parents, finished by 4 worker processes
   (`python -m asyncjobq worker benchmarks.workflows_app:queue`), `--repeats` (20) times: how
   many times each child ran (1 every time), and how long each fan-in took.
2. chain: `--chain` (1,000) jobs, each after the one before, one worker process: that they ran
   in order, and the time from a parent's `done` (its finished_at, the flush's transaction
   start) to its child's start, p50 / p99.
3. enqueue: a 10,000-job workflow (one root, 9,998 children, one fan-in), medians of 3: the
   time `Workflow.enqueue` takes and the statements it sends (counted on the connection).
4. rollback: the same workflow enqueued in a transaction that rolls back leaves no job and no
   edge.

    ASYNCJOBQ_DSN=postgresql://... .venv/bin/python -m benchmarks.workflows
        [--parents 10000 --repeats 20 --chain 1000 --parts fanin,chain,enqueue] [--label r1]

Prints JSON, writes benchmarks/results/workflows-<parts>.json; figures in
results/WORKFLOWS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from typing import Any

import psycopg

from asyncjobq import Queue

from .common import save_parts, spawn_app_worker
from .waits import pct

SCHEMA = "bench_workflows"


def spawn_worker(dsn: str, *extra: str) -> subprocess.Popen[bytes]:
    return spawn_app_worker("benchmarks.workflows_app:queue", dsn, *extra)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


async def scalar(q: Queue, query: str, *params: Any) -> Any:
    async with q.connection() as c:
        cur = await c.execute(query.replace("{s}", SCHEMA), params)
        row = await cur.fetchone()
        return None if row is None else row[0]


async def fan_in(dsn: str, parents: int, repeats: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA)
    procs = [spawn_worker(dsn, "--concurrency", "20", "--batch", "20") for _ in range(4)]
    runs, seconds, gaps = [], [], []
    try:
        async with q:
            for _ in range(repeats):
                wf = q.workflow()
                steps = [wf.add("part", {"i": i}) for i in range(parents)]
                wf.add("gather", {}, after=steps)
                t0 = time.perf_counter()
                ids = await wf.enqueue()
                info = await q.wait(ids[-1], timeout=600)
                seconds.append(time.perf_counter() - t0)
                assert info.status == "done" and info.result == sum(range(parents)), info
                runs.append(await scalar(q, "SELECT count(*) FROM {s}.runs WHERE job_id = %s",
                                         ids[-1]))
                # Where a slow fan-in's time went: from its last parent's end to the child's
                # claim (the child's row in history keeps no start; its run's log row does).
                gaps.append(await scalar(
                    q, "SELECT round(1000 * extract(epoch FROM (SELECT max(at) FROM {s}.runs"
                       " WHERE job_id = %s) - (SELECT max(finished_at) FROM {s}.jobs_history"
                       " WHERE id = ANY(%s))))::int", ids[-1], ids[:-1]))
            pids = await scalar(q, "SELECT count(DISTINCT locked_by) FROM {s}.jobs_history"
                                   " WHERE task = 'part'")
    finally:
        stop(procs)
    return {"parents": parents, "repeats": repeats, "worker_processes": 4,
            "child_runs": runs, "every_child_ran_once": all(r == 1 for r in runs),
            "workers_that_finished_parents": pids,
            "seconds_per_fan_in": {"median": round(statistics.median(seconds), 2),
                                   "max": round(max(seconds), 2),
                                   "all": [round(x, 2) for x in seconds]},
            "last_parent_done_to_child_logged_ms": gaps}


async def chain(dsn: str, n: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA)
    proc = spawn_worker(dsn)
    try:
        async with q:
            wf = q.workflow()
            prev = wf.add("link", {"n": 0})
            for i in range(1, n):
                prev = wf.add("link", {"n": i}, after=[prev])
            t0 = time.perf_counter()
            ids = await wf.enqueue()
            await q.wait(ids[-1], timeout=600)
            total = time.perf_counter() - t0
            async with q.connection() as c:
                cur = await c.execute(
                    f"SELECT id, result, extract(epoch FROM finished_at)::float8"
                    f" FROM {SCHEMA}.jobs_history WHERE id = ANY(%s) ORDER BY id", (ids,))
                rows = {r[0]: (r[1], r[2]) for r in await cur.fetchall()}
    finally:
        stop([proc])
    results = [rows[i][0] for i in ids]
    in_order = (all(r["after_parent"] for r in results)
                and [r["n"] for r in sorted(results, key=lambda r: r["started"])]
                == list(range(n)))
    gaps = [1000 * (results[k]["started"] - rows[ids[k - 1]][1]) for k in range(1, n)]
    return {"jobs": n, "ran_in_order": in_order, "seconds": round(total, 2),
            "parent_done_to_child_start_ms": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99)}}


class Counting(psycopg.AsyncConnection[Any]):
    """Counts the statements sent through execute()."""

    sent = 0

    async def execute(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        Counting.sent += 1
        return await super().execute(*args, **kwargs)


def big_workflow(q: Queue, n: int) -> Any:
    wf = q.workflow()
    root = wf.add("part", {"i": 0})
    middle = [wf.add("part", {"i": i}, after=[root]) for i in range(1, n - 1)]
    wf.add("gather", {}, after=middle)
    return wf


async def enqueue(dsn: str, n: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA)
    times, sent = [], []
    async with q:
        await q.pause("default")  # nothing runs: only the enqueue is measured
        try:
            for _ in range(3):
                wf = big_workflow(q, n)
                t0 = time.perf_counter()
                await wf.enqueue()
                times.append(time.perf_counter() - t0)
            for _ in range(3):
                wf = big_workflow(q, n)
                async with await Counting.connect(dsn) as conn:
                    async with conn.transaction():
                        Counting.sent = 0
                        await wf.enqueue(conn=conn)
                        sent.append(Counting.sent)
            # In a transaction that rolls back: nothing is left.
            before = (await scalar(q, "SELECT count(*) FROM {s}.jobs"),
                      await scalar(q, "SELECT count(*) FROM {s}.job_deps"))
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                async with conn.transaction(force_rollback=True):
                    await big_workflow(q, n).enqueue(conn=conn)
            after = (await scalar(q, "SELECT count(*) FROM {s}.jobs"),
                     await scalar(q, "SELECT count(*) FROM {s}.job_deps"))
        finally:
            await q.resume("default")
    return {"jobs": n, "edges": 2 * (n - 2),
            "seconds": {"median": round(statistics.median(times), 3),
                        "runs": [round(t, 3) for t in times]},
            "statements_sent": sent, "rollback_leaves_nothing": before == after}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    dsn = os.environ["ASYNCJOBQ_DSN"]
    q = Queue(dsn, schema=SCHEMA)
    async with q:
        async with q.connection() as c:
            await c.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await q.install()
        async with q.connection() as c:
            await c.execute(f"CREATE TABLE {SCHEMA}.runs (job_id bigint NOT NULL,"
                            " at timestamptz NOT NULL DEFAULT clock_timestamp())")
    out: dict[str, Any] = {}
    if "fanin" in args.parts:
        out["fan_in"] = await fan_in(dsn, args.parents, args.repeats)
    if "chain" in args.parts:
        out["chain"] = await chain(dsn, args.chain)
    if "enqueue" in args.parts:
        out["enqueue"] = await enqueue(dsn, 10_000)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--parents", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chain", type=int, default=1000)
    p.add_argument("--parts", default="fanin,chain,enqueue")
    p.add_argument("--label", default="")
    a = p.parse_args()
    save_parts("workflows", a.parts, asyncio.run(main(a)), a.label)
