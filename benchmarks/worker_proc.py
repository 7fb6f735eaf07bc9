"""One benchmark worker process: an asyncjobq Worker with one task, `noop`.

Started by common.Workers. It opens its pool, prints `ready`, waits for `go` on stdin, runs the
worker until SIGTERM, then writes what it saw to --out as JSON: the job ids it executed (for
counting double claims), enqueue-to-start latencies, peak RSS and CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from asyncjobq import Job, Queue, Worker
from asyncjobq.runtime import run


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


async def main(args: argparse.Namespace) -> dict[str, Any]:
    queue = Queue(args.dsn, schema=args.schema)
    ids: list[int] = []
    latencies: list[float] = []
    record = args.record
    sleep = args.sleep

    result = {"status": "ok", "rows": 42} if args.return_result else None

    @queue.task(name="noop")
    async def noop(job: Job) -> dict[str, Any] | None:
        if record == "latency":
            latencies.append(time.clock_gettime(time.CLOCK_MONOTONIC) - job.payload["t"])
        elif record == "ids":
            ids.append(job.id)
        if sleep:
            await asyncio.sleep(sleep)
        return result

    if args.limited_task:
        # Never enqueued: its limit only makes every claim of this worker the limited one.
        @queue.task(name="limited_other", concurrency_limit=1)
        async def limited_other(job: Job) -> None:
            pass

    if args.limited_elsewhere:
        # A limited task of another queue, which this worker (of `default`) does not serve:
        # its limit must cost this worker nothing.
        @queue.task(name="limited_export", queue="exports", concurrency_limit=1)
        async def limited_export(job: Job) -> None:
            pass

    kwargs: dict[str, Any] = {}
    if args.concurrency:
        kwargs["concurrency"] = args.concurrency
    if args.batch:
        kwargs["batch_size"] = args.batch
    if args.metrics_port is not None:
        kwargs["metrics_port"] = args.metrics_port
    if args.no_vacuum:
        kwargs["vacuum_interval"] = None
    worker = Worker(queue, poll_interval=args.poll_interval, listen=not args.listen_off,
                    **kwargs)
    await queue.open()
    print("ready", flush=True)
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    if line.strip() != "go":
        return {}
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.stop)
    samples: list[int] = []

    async def sample_rss() -> None:
        while True:
            samples.append(_rss_kb())
            await anyio.sleep(0.5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_rss)
        await worker.run()
        tg.cancel_scope.cancel()
    await queue.close()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "ids": ids, "latencies": latencies, "maxrss_kb": ru.ru_maxrss,
        "cpu_s": ru.ru_utime + ru.ru_stime, "completed": worker.completed,
        "rss_samples_kb": samples,
    }


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", required=True)
    p.add_argument("--concurrency", type=int, default=0, help="0: the Worker's default")
    p.add_argument("--batch", type=int, default=0, help="0: the Worker's default")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument("--no-listen", dest="listen_off", action="store_true")
    p.add_argument("--record", choices=["ids", "latency", "none"], default="ids")
    p.add_argument("--out", required=True)
    # The metrics A/B (benchmarks/metrics_ab.py): 0 serves /metrics on a free port.
    p.add_argument("--metrics-port", type=int, default=None)
    # The flow-control A/B (benchmarks/limits_ab.py): also register a limited task.
    p.add_argument("--limited-task", action="store_true")
    # ... or a limited task of another queue (`exports`), which this worker does not serve.
    p.add_argument("--limited-elsewhere", action="store_true")
    # The results A/B: the handler returns a small dict, stored as each job's result.
    p.add_argument("--return-result", action="store_true")
    # Without the leader's vacuum of the hot table (Worker(vacuum_interval=None)).
    p.add_argument("--no-vacuum", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    a = parse()
    Path(a.out).write_text(json.dumps(run(main, a)))
