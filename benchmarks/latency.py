"""6. Latency: enqueue() call -> handler start, on an idle worker, with LISTEN and poll only.

One worker process (default settings) waits on an empty queue. The producer enqueues one job
at a time, stamping CLOCK_MONOTONIC (system-wide on Linux) into the payload just before the
call; the handler subtracts it on entry. Jobs are spaced `gap` apart so the worker is idle each
time. With LISTEN off the worker finds jobs only by its poll (poll_interval 1 s, the default).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncjobq import Queue

from .common import Server, Workers, drop_schema, percentile, prepare_jobs, wait_drained

SCHEMA = "bench_latency"


async def _produce(dsn: str, n: int, gap: float) -> None:
    q = Queue(dsn, schema=SCHEMA)
    async with q:
        for _ in range(n):
            await q.enqueue("noop", {"t": time.clock_gettime(time.CLOCK_MONOTONIC)})
            await asyncio.sleep(gap)


def cell(server: Server, n: int, listen: bool, gap: float = 0.005) -> dict[str, Any]:
    prepare_jobs(server, SCHEMA, 0)
    w = Workers(server, SCHEMA, 1, concurrency=0, batch=0, listen=listen, record="latency")
    try:
        w.wait_ready()
        w.go()
        time.sleep(0.3)  # the worker's first (empty) claim and LISTEN are done: it is idle
        asyncio.run(_produce(server.dsn, n, gap))
        wait_drained(server, SCHEMA)
        res = w.stop()
    except BaseException:
        w.kill()
        raise
    drop_schema(server, SCHEMA)
    lat = [x * 1000 for x in res[0].latencies]
    return {"n": len(lat), "p50_ms": percentile(lat, 50), "p95_ms": percentile(lat, 95),
            "p99_ms": percentile(lat, 99), "max_ms": max(lat) if lat else float("nan")}


def cells(server: Server, n: int) -> list[tuple[str, Any]]:
    return [("latency listen", lambda: cell(server, n, True)),
            ("latency poll only", lambda: cell(server, n, False))]
