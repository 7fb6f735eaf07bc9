"""The benchmark suite's one entry point: `make bench` (full) or `make bench-quick` (< 3 min).

    .venv/bin/python -m benchmarks.run [--quick] [--rounds N] [--only ceiling,drain,...]
    .venv/bin/python -m benchmarks.run --render     # rewrite RESULTS.md/PNGs from results.json

Every cell of every measurement runs once per round, all in the same order each round
(A B C ... A B C ...), so the machine's drift and other load spread over all of them; each
table shows the median of the rounds (and the spread). Ratios compare medians from this run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from . import ceiling, drain, enqueue, io_bound, latency, locks, memory, redis_cmp
from .common import RESULTS, log, run_rounds, start_server
from .report import outdir, render

MEASUREMENTS = ["ceiling", "drain", "io", "locks", "enqueue", "latency", "redis", "memory"]


@dataclass
class Settings:
    rounds: int
    ceiling_batches: list[int]
    ceiling_clients: list[int]
    pgbench_seconds: int
    drain_jobs: int
    drain_procs: list[int]
    drain_batches: list[int]
    io_jobs: int
    io_settings: list[tuple[int, int]]
    lock_workers: list[int]
    lock_jobs: int
    enqueue_one: int
    enqueue_many: int
    latency_jobs: int
    redis_workers: int
    redis_jobs: int
    memory_small: int
    memory_large: int


FULL = Settings(
    rounds=3, ceiling_batches=[1, 10, 50], ceiling_clients=[1, 2, 4, 8], pgbench_seconds=5,
    drain_jobs=50_000, drain_procs=[1, 2, 4], drain_batches=[1, 10, 50],
    io_jobs=50_000, io_settings=[(50, 0), (200, 0), (200, 50)],
    lock_workers=[2, 4, 8], lock_jobs=5_000,
    enqueue_one=5_000, enqueue_many=10_000, latency_jobs=1_000,
    redis_workers=4, redis_jobs=20_000, memory_small=50_000, memory_large=500_000,
)
QUICK = Settings(
    rounds=3, ceiling_batches=[1, 10, 50], ceiling_clients=[1, 4], pgbench_seconds=1,
    drain_jobs=3_000, drain_procs=[1, 4], drain_batches=[1, 10, 50],
    io_jobs=5_000, io_settings=[(50, 0), (200, 0)],
    lock_workers=[4], lock_jobs=1_000,
    enqueue_one=1_000, enqueue_many=10_000, latency_jobs=200,
    redis_workers=4, redis_jobs=5_000, memory_small=2_000, memory_large=20_000,
)


def versions(server_info: dict[str, str], redis_version: str | None) -> dict[str, str]:
    import anyio
    import psycopg
    import psycopg_pool
    import uvloop

    import asyncjobq

    out = {
        "PostgreSQL": server_info.get("server_version", "?"),
        "pgbench": server_info.get("pgbench", "?"),
        "Python": platform.python_version(),
        "psycopg": f"{psycopg.__version__} (libpq {psycopg.pq.version()}, "
                   f"{psycopg.pq.__impl__})",
        "psycopg_pool": psycopg_pool.__version__,
        "anyio": anyio.__version__ if hasattr(anyio, "__version__") else _dist("anyio"),
        "uvloop": uvloop.__version__,
        "asyncjobq": f"{asyncjobq.__version__ if hasattr(asyncjobq, '__version__') else '0.1.0'}"
                     f" (git {_git_rev()})",
    }
    if redis_version:
        import redis

        out["Redis server"] = redis_version
        out["redis-py"] = redis.__version__
    return out


def _dist(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _git_rev() -> str:
    p = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                       text=True)
    return p.stdout.strip() or "?"


def machine() -> dict[str, str]:
    import os

    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f"{kb / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "CPU": cpu, "RAM": mem,
            "kernel": platform.release(), "loadavg at start": " ".join(
                f"{x:.2f}" for x in os.getloadavg())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer jobs and cells (< 3 minutes)")
    p.add_argument("--rounds", type=int, help="rounds per cell (default 3; at least 3)")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(MEASUREMENTS)}")
    p.add_argument("--render", action="store_true", help="only re-render from results.json")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.render:
        name = "quick/results.json" if args.quick else "results.json"
        render(json.loads((RESULTS / name).read_text()))
        return
    s = QUICK if args.quick else FULL
    if args.rounds:
        s.rounds = args.rounds
    only = set(args.only.split(",")) if args.only else set(MEASUREMENTS)
    unknown = only - set(MEASUREMENTS)
    if unknown:
        p.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")
    started = time.time()
    mach = machine()
    server = start_server()
    rserver = None
    try:
        cells: list[tuple[str, Any]] = []
        if "ceiling" in only:
            ceiling.setup(server)
            cells += ceiling.cells(server, s.ceiling_batches, s.ceiling_clients,
                                   s.pgbench_seconds)
        if "drain" in only:
            cells += drain.cells(server, s.drain_jobs, s.drain_procs, s.drain_batches)
        if "io" in only:
            cells += io_bound.cells(server, s.io_jobs, s.io_settings)
        if "locks" in only:
            cells += locks.cells(server, s.lock_workers, s.lock_jobs)
        if "enqueue" in only:
            cells += enqueue.cells(server, s.enqueue_one, s.enqueue_many, s.pgbench_seconds)
        if "latency" in only:
            cells += latency.cells(server, s.latency_jobs)
        if "redis" in only:
            rserver = redis_cmp.RedisServer()
            cells += redis_cmp.cells(rserver, s.redis_workers, s.redis_jobs)
        if "memory" in only:
            cells += memory.cells(server, s.memory_small, s.memory_large)
        raw = run_rounds(cells, s.rounds, "bench")
        if "ceiling" in only:
            ceiling.teardown(server)
        data = {
            "command": " ".join(["python", "-m", "benchmarks.run", *sys.argv[1:]]),
            "mode": "quick" if args.quick else "full",
            "settings": s.__dict__,
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
            "duration_s": time.time() - started,
            "machine": mach,
            "server": {**server.info, "embedded": str(server.embedded),
                       "connection": "unix socket" if "host=/" in server.dsn else "tcp"},
            "versions": versions(server.info, rserver.version if rserver else None),
            "redis": {"url": rserver.url, "persistence": rserver.persistence}
            if rserver else None,
            "raw": raw,
        }
        out = outdir(data)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(data, indent=1))
        render(data)
        log(f"done in {time.time() - started:.0f} s: {out / 'RESULTS.md'}")
    finally:
        if rserver is not None:
            rserver.stop()
        server.stop()


if __name__ == "__main__":
    main()
