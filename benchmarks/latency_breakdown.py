"""Where the enqueue -> handler-start latency goes, hop by hop (a diagnostic, not in `make bench`).

    .venv/bin/python -m benchmarks.latency_breakdown [--jobs 600]

One idle default worker in a child process; this process enqueues one job every 5 ms, stamping
CLOCK_MONOTONIC (system-wide) into the payload before the call. The worker stamps, for each
job, when the notification reached the listener, when the fetcher's claim was sent and returned,
and when the handler began; it prints the median and p90 of each stamp relative
to the enqueue() call. Hooks wrap Listener._dispatch and Fetcher.claim in the
child only. Uses $ASYNCJOBQ_DSN, else the embedded server.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from asyncjobq import Job, Queue, Worker
from asyncjobq import fetcher as fetcher_mod
from asyncjobq import listener as listener_mod
from asyncjobq.runtime import run

from .common import drop_schema, percentile, start_server

SCHEMA = "bench_latency_breakdown"
HOPS = ("notification received", "claim sent", "claim returned", "handler started")


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _hook(stamps: dict[str, float]) -> None:
    dispatch = listener_mod.Listener._dispatch
    claim = fetcher_mod.Fetcher.claim

    def timed_dispatch(self: Any, payload: str) -> None:
        stamps.setdefault(HOPS[0], _now())
        dispatch(self, payload)

    async def timed_claim(self: Any, limit: int) -> list[Job]:
        sent = _now()
        jobs = await claim(self, limit)
        if jobs:
            stamps.setdefault(HOPS[1], sent)
            stamps.setdefault(HOPS[2], _now())
        return jobs

    listener_mod.Listener._dispatch = timed_dispatch  # type: ignore[method-assign]
    fetcher_mod.Fetcher.claim = timed_claim  # type: ignore[method-assign]


async def _worker(dsn: str, seconds: float) -> None:
    stamps: dict[str, float] = {}
    rows: list[list[float]] = []
    _hook(stamps)
    q = Queue(dsn, schema=SCHEMA)

    @q.task(name="noop")
    async def noop(job: Job) -> None:
        stamps[HOPS[3]] = _now()
        rows.append([stamps.get(h, float("nan")) - job.payload["t"] for h in HOPS])
        stamps.clear()

    w = Worker(q)
    asyncio.get_running_loop().call_later(seconds, w.stop)
    await w.run()
    rows = rows[20:]  # warm-up
    print(f"{len(rows)} jobs; milliseconds since the enqueue() call:")
    print("| hop | p50 | p90 |\n|---|---|---|")
    for i, hop in enumerate(HOPS):
        xs = [r[i] * 1000 for r in rows if r[i] == r[i]]
        print(f"| {hop} | {percentile(xs, 50):.2f} | {percentile(xs, 90):.2f} |")


async def _produce(dsn: str, n: int) -> None:
    async with Queue(dsn, schema=SCHEMA) as q:
        await q.install()
        took: list[float] = []
        for _ in range(n):
            t = _now()
            await q.enqueue("noop", {"t": t})
            took.append((_now() - t) * 1000)
            await asyncio.sleep(0.005)
        if took:
            print(f"enqueue() returned: p50 {percentile(took, 50):.2f} ms, "
                  f"p90 {percentile(took, 90):.2f} ms (producer's side)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=600)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run(_worker, args.child, args.jobs * 0.0075 + 2.0)
        return
    server = start_server()
    try:
        drop_schema(server, SCHEMA)
        run(_produce, server.dsn, 0)  # install before the worker checks the schema
        child = subprocess.Popen([sys.executable, "-m", "benchmarks.latency_breakdown",
                                  "--jobs", str(args.jobs), "--child", server.dsn])
        time.sleep(1.5)  # the worker's first empty claim and LISTEN are done: it is idle
        run(_produce, server.dsn, args.jobs)
        child.wait()
        drop_schema(server, SCHEMA)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
