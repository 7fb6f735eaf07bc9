"""2. asyncjobq drain: N zero-work jobs pre-enqueued, drained by worker processes.

Workers start, open their pools and wait; all are released at once (t0, wall clock). The run
ends at the last job's completion as the database recorded it (max(finished_at) in
jobs_history, the completion statement's now()). Each process logs the ids it executed; an id
executed twice is a double claim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .common import (
    Server,
    Workers,
    checkpoint,
    double_claims,
    drop_schema,
    last_finished,
    prepare_jobs,
    server_cpu_s,
    wait_drained,
)


def drain(server: Server, schema: str, jobs: int, procs: int, *, concurrency: int = 0,
          batch: int = 0, sleep: float = 0.0, record: str = "ids",
          extra: Sequence[str] = ()) -> dict[str, Any]:
    prepare_jobs(server, schema, jobs)
    checkpoint(server)
    w = Workers(server, schema, procs, concurrency=concurrency, batch=batch, sleep=sleep,
                record=record, extra=extra)
    try:
        w.wait_ready()
        cpu0 = server_cpu_s()
        t0 = w.go()
        wait_drained(server, schema)
        cpu1 = server_cpu_s()
        done, t1 = last_finished(server, schema)
        results = w.stop()
    except BaseException:
        w.kill()
        raise
    drop_schema(server, schema)
    extra, twice = double_claims(results) if record == "ids" else (0, 0)
    elapsed = t1 - t0
    return {
        "jobs_per_s": done / elapsed if elapsed > 0 else float("nan"),
        "elapsed_s": elapsed, "done": done, "expected": jobs,
        "double_claims": twice, "extra_executions": extra,
        "executions": sum(len(r.ids) for r in results) if record == "ids" else None,
        "worker_cpu_s": sum(r.cpu_s for r in results),
        # The server's CPU from release to drained (benchmarks/common.py: server_cpu_s).
        "server_cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
        "maxrss_mb": max(r.maxrss_kb for r in results) / 1024,
        "rss_samples_mb": [round(x / 1024, 1) for r in results for x in r.rss_samples_kb],
    }


def cells(server: Server, jobs: int, procs: list[int], batches: list[int]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [
        ("drain default p=1", lambda: drain(server, "bench_drain", jobs, 1))]
    for p in procs:
        for b in batches:
            # Concurrency: the default 20, or twice the batch so that a full batch fits.
            conc = max(20, 2 * b)
            out.append((f"drain p={p} b={b}",
                        lambda p=p, b=b, conc=conc: drain(server, "bench_drain", jobs, p,
                                                         concurrency=conc, batch=b)))
    return out
