"""Results, waits and cancels (docs/guides/results.md), three figures:

1. `wait` latency: 1,000 jobs one after another, each enqueued then waited for, run by a worker
   process (`python -m asyncjobq worker benchmarks.waits_app:queue`). Two clocks: from the
   handler's return (its result carries time.time()) and from the job's finished_at (the
   flush's transaction start) to `wait` returning.
2. 10,000 waits at once in this process: the queue paused, 10,000 jobs enqueued and waited
   for, then resumed. Listening connections, this process's memory (RSS) and CPU for them.
3. Cancelling running jobs: 100 async handlers (cancelled: CancelledError) and 100 sync ones
   (reading job.cancel_requested every 10 ms), one at a time, in a worker of this process:
   from `cancel` being called (its statement included) to the handler seeing it.

    ASYNCJOBQ_DSN=postgresql://... .venv/bin/python -m benchmarks.waits [--jobs 1000]
        [--parts latency,many,cancel]

Prints JSON, writes benchmarks/results/waits-<parts>.json; figures in results/WAITS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import threading
import time
from typing import Any

from asyncjobq import Job, Queue, Worker

from .common import save_parts, spawn_app_worker

SCHEMA = "bench_waits"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def spawn_worker(dsn: str, *extra: str) -> subprocess.Popen[bytes]:
    return spawn_app_worker("benchmarks.waits_app:queue", dsn, *extra)


async def latency(dsn: str, jobs: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA)
    worker = spawn_worker(dsn)
    try:
        async with q:
            for _ in range(20):  # warm: the worker is up and listening
                await q.wait(await q.enqueue("stamp", {}), timeout=60)
            from_return, from_finish = [], []
            for _ in range(jobs):
                job_id = await q.enqueue("stamp", {})
                info = await q.wait(job_id, timeout=60)
                now = time.time()
                from_return.append(1000 * (now - info.result["t"]))
                assert info.finished_at is not None
                from_finish.append(1000 * (now - info.finished_at.timestamp()))
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    return {"jobs": jobs,
            "from_handler_return_ms": {"p50": pct(from_return, 0.5),
                                       "p99": pct(from_return, 0.99)},
            "from_finished_at_ms": {"p50": pct(from_finish, 0.5),
                                    "p99": pct(from_finish, 0.99)}}


async def many_waits(dsn: str, n: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA, pool_max_size=10)
    async with q:
        await q.pause("default")
        ids = await q.enqueue_many("stamp", [{} for _ in range(n)])
        rss0, cpu0, t0 = rss_mb(), time.process_time(), time.monotonic()
        waits = [asyncio.create_task(q.wait(i, timeout=600)) for i in ids]
        await asyncio.sleep(0)  # the waits start
        waiter = q._waiter
        assert waiter is not None
        while waiter.reads == 0 or waiter._unmarked:  # noqa: ASYNC110 (the waiter's state)
            await asyncio.sleep(0.01)
        registered_s = time.monotonic() - t0
        cpu_registered = time.process_time() - cpu0
        await asyncio.sleep(5)  # a quiet wait: what waiting costs per second
        cpu_idle = time.process_time() - cpu0 - cpu_registered
        rss1 = rss_mb()
        async with q.connection() as c:
            cur = await c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name"
                                  " = 'asyncjobq-wait' AND datname = current_database()")
            listening = (await cur.fetchone() or (0,))[0]
        t1, cpu1 = time.monotonic(), time.process_time()
        worker = spawn_worker(dsn, "--concurrency", "100")
        try:
            await q.resume("default")
            infos = await asyncio.gather(*waits)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
        assert all(i.status == "done" for i in infos)
        return {"waits": n, "listening_connections": listening,
                "register_s": round(registered_s, 2),
                "cpu_s_to_register": round(cpu_registered, 2),
                "cpu_s_per_quiet_second": round(cpu_idle / 5, 4),
                "rss_mb_for_waits": round(rss1 - rss0, 1),
                "drained_s": round(time.monotonic() - t1, 2),
                "cpu_s_while_drained": round(time.process_time() - cpu1, 2),
                "statements_reading": waiter.reads,
                "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


async def cancels(dsn: str, n: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA + "_cancel")
    async with q:
        async with q.connection() as c:
            await c.execute(f"DROP SCHEMA IF EXISTS {SCHEMA}_cancel CASCADE")
        await q.install()
        started = asyncio.Event()
        started_sync = threading.Event()
        seen: list[float] = []

        @q.task()
        async def long_async(job: Job) -> None:
            started.set()
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                seen.append(time.monotonic())
                raise

        @q.task()
        def long_sync(job: Job) -> None:
            started_sync.set()
            for _ in range(60_000):
                if job.cancel_requested:
                    seen.append(time.monotonic())
                    return
                time.sleep(0.01)

        w = Worker(q, concurrency=10)
        run = asyncio.create_task(w.run())
        out: dict[str, Any] = {}
        try:
            for name, task in (("async", long_async), ("sync", long_sync)):
                took: list[float] = []
                for _ in range(n):
                    started.clear()
                    started_sync.clear()
                    del seen[:]
                    job_id = await task.enqueue({})
                    # One of two events, one of them a thread's.
                    while not (started.is_set() or started_sync.is_set()):  # noqa: ASYNC110
                        await asyncio.sleep(0.002)
                    asked = time.monotonic()  # before the cancel's own statement
                    assert await q.cancel(job_id)
                    info = await q.wait(job_id, timeout=60)
                    assert info.status == "cancelled", info
                    took.append(1000 * (seen[0] - asked))
                out[name] = {"cancels": n, "p50_ms": pct(took, 0.5), "p99_ms": pct(took, 0.99),
                             "max_ms": round(max(took), 2)}
        finally:
            w.stop()
            await run
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    dsn = os.environ["ASYNCJOBQ_DSN"]
    q = Queue(dsn, schema=SCHEMA)
    async with q:
        async with q.connection() as c:
            await c.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await q.install()
    out: dict[str, Any] = {}
    if "latency" in args.parts:
        out["wait_latency"] = await latency(dsn, args.jobs)
    if "many" in args.parts:
        out["many_waits"] = await many_waits(dsn, args.waits)
    if "cancel" in args.parts:
        out["cancel_running"] = await cancels(dsn, args.cancels)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--waits", type=int, default=10_000)
    p.add_argument("--cancels", type=int, default=100)
    p.add_argument("--parts", default="latency,many,cancel")
    a = p.parse_args()
    save_parts("waits", a.parts, asyncio.run(main(a)))
