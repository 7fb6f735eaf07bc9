"""Pinned horizon: jobs offered at a steady rate while something stops VACUUM, and what the
workers' claims, the backlog and the hot table do meanwhile.

    .venv/bin/python -m benchmarks.pinned --rate 1000 --pressure idle --pin 120
    .venv/bin/python -m benchmarks.pinned --rate 2000 --pressure readers --pin 120
    .venv/bin/python -m benchmarks.pinned --summary floors   # medians of runs labelled floors-r<n>

Phases: `--warm` seconds clean, `--pin` seconds under pressure, `--after` seconds released.
Pressure `idle`: a transaction that wrote a row (to a table of its own) and then sits idle.
`readers`: 4 REPEATABLE READ sessions, each holding its snapshot for 30 s over a scan of
jobs_history, started 7.5 s apart and renewed, so that a snapshot is always open.
`scanners`: the same sessions and scans at READ COMMITTED (a control: the scans without the
horizon held between them).

Claim time is what the workers' claim statements took, timed around the statement in each
worker process (the fetcher's claims and the completer's flushes that carry one); the
figures are per phase. Throughput is jobs finished per second; backlog is the jobs queued
at each sample. Writes benchmarks/results/pinned-<pressure>-<rate>.json.
Uses $ASYNCJOBQ_DSN when set, else the embedded PostgreSQL of benchmarks/common.py.

This file is also the workers' APP (`benchmarks.pinned:queue`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from asyncjobq import Job, Queue

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCHEMA = "pinned"
DSN_ENV = "ASYNCJOBQ_PINNED_DSN"
TIMINGS_ENV = "ASYNCJOBQ_PINNED_TIMINGS"

queue = Queue(os.environ.get(DSN_ENV), schema=SCHEMA, pool_max_size=4)


@queue.task(name="noop")
async def noop(job: Job) -> None:
    pass


def _time_claims(path: str) -> None:
    """In a worker process: record (end time, seconds) of every claim statement."""
    from asyncjobq._worker import completer, fetcher

    out: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timed(fn: Any) -> Any:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                with lock:
                    out.append((time.time(), time.perf_counter() - t))
        return wrapper

    fetcher.Fetcher.claim = timed(fetcher.Fetcher.claim)  # type: ignore[method-assign]
    completer.Completer._set_outcomes_then_claim = timed(  # type: ignore[method-assign]
        completer.Completer._set_outcomes_then_claim)

    def flush() -> None:
        while True:
            time.sleep(1.0)
            with lock:
                batch = out[:]
                out.clear()
            if batch:
                with open(path, "a") as f:
                    f.writelines(f"{a:.4f} {b:.6f}\n" for a, b in batch)

    threading.Thread(target=flush, daemon=True).start()


if os.environ.get(TIMINGS_ENV):
    _time_claims(os.environ[TIMINGS_ENV])

NO_VACUUM_ENV = "ASYNCJOBQ_PINNED_NO_LEADER_VACUUM"
if os.environ.get(NO_VACUUM_ENV):
    # --no-leader-vacuum: the workers' leader never vacuums jobs (autovacuum still may).
    from asyncjobq._maintenance.vacuum import HotTableVacuum

    async def _no_vacuum(self: HotTableVacuum) -> bool:
        return False

    HotTableVacuum.turn = _no_vacuum  # type: ignore[method-assign]


# `jobs` and, were it partitioned, its partitions.
STATS = sql.SQL(
    "SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0), coalesce(sum(s.n_dead_tup), 0),"
    " (SELECT count(*) FILTER (WHERE status = 'queued') FROM {s}.jobs),"
    " (SELECT coalesce(sum(n), 0) FROM {s}.history_counts)"
    " FROM (SELECT relid FROM pg_partition_tree({j}::regclass) UNION SELECT {j}::regclass) t"
    " LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid")


# --history: what a pin does to history, which the pruner and the dashboard read.
HISTORY = sql.SQL(
    "SELECT pg_total_relation_size({h}::regclass), pg_total_relation_size({c}::regclass),"
    " coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = {c}::regclass), 0)")


async def _ms(call: Any) -> float:
    t0 = time.perf_counter()
    await call
    return round((time.perf_counter() - t0) * 1000, 2)


class Run:
    def __init__(self, dsn: str, a: argparse.Namespace) -> None:
        self.dsn, self.a = dsn, a
        self.q = Queue(dsn, schema=SCHEMA, pool_max_size=8)
        self.stop = asyncio.Event()
        self.samples: list[dict[str, Any]] = []
        self.phase = "warm"
        self.timings = Path(tempfile.gettempdir()) / f"asyncjobq-pinned-timings-{os.getpid()}"

    async def produce(self) -> None:
        tick = 0.05
        chunk = max(1, round(self.a.rate * tick))
        next_at = time.monotonic()
        while not self.stop.is_set():
            await self.q.enqueue_many("noop", [{}] * chunk)
            next_at += chunk / self.a.rate
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def sample(self) -> dict[str, Any]:
        async with self.q.connection() as conn:
            cur = await conn.execute(STATS.format(j=sql.Literal(f"{SCHEMA}.jobs"),
                                                  s=sql.Identifier(SCHEMA)))
            size, dead, queued, done = await cur.fetchone() or (0, 0, 0, 0)
        out = {"t": time.time(), "phase": self.phase, "size": int(size), "dead": int(dead),
               "queued": int(queued), "done": int(done)}
        if self.a.history:
            async with self.q.connection() as conn:
                cur = await conn.execute(HISTORY.format(
                    h=sql.Literal(f"{SCHEMA}.jobs_history"),
                    c=sql.Literal(f"{SCHEMA}.history_counts")))
                hsize, csize, cdead = await cur.fetchone() or (0, 0, 0)
            out.update({
                "history_size": int(hsize), "counts_size": int(csize), "counts_dead": int(cdead),
                "stats_ms": await _ms(self.q.stats()),
                "list_done_ms": await _ms(self.q.list_jobs(status="done")),
                "count_ms": await _ms(self.q.count_jobs()),
                "throughput_ms": await _ms(self.q.throughput(60))})
        return out

    async def prunes(self) -> dict[str, Any]:
        """At the pin's end: history older than 30 s deleted, then the same call again (it
        finds nothing to delete, past the rows the first one left dead)."""
        t0 = time.perf_counter()
        first = sum((await self.q.prune(older_than=30)).values())
        t1 = time.perf_counter()
        second = sum((await self.q.prune(older_than=30)).values())
        t2 = time.perf_counter()
        return {"prune_deleted": first, "prune_ms": round((t1 - t0) * 1000, 1),
                "prune_again_deleted": second, "prune_again_ms": round((t2 - t1) * 1000, 1)}

    async def hold_idle(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn) as c:
            await c.execute("CREATE TABLE IF NOT EXISTS public.pinned_bench_pin (x int)")
            await c.commit()
            await c.execute("INSERT INTO public.pinned_bench_pin VALUES (1)")
            await self.stop_pin.wait()
            await c.rollback()

    async def reader(self, delay: float) -> None:
        await asyncio.sleep(delay)
        async with await psycopg.AsyncConnection.connect(self.dsn) as c:
            while not self.stop_pin.is_set():
                # `scanners`: the same scans at READ COMMITTED, holding no snapshot between
                # them: the scans' own cost, without a horizon held for 30 s.
                await c.execute("BEGIN ISOLATION LEVEL " + (
                    "READ COMMITTED" if self.a.pressure == "scanners" else "REPEATABLE READ"))
                await c.execute(sql.SQL("SELECT count(*) FROM {}.jobs_history").format(
                    sql.Identifier(SCHEMA)))
                try:
                    await asyncio.wait_for(self.stop_pin.wait(), 30.0)
                except TimeoutError:
                    pass
                await c.execute("COMMIT")

    async def run(self) -> None:
        a = self.a
        env = {**os.environ, DSN_ENV: self.dsn, TIMINGS_ENV: str(self.timings),
               **({NO_VACUUM_ENV: "1"} if a.no_leader_vacuum else {})}
        self.timings.unlink(missing_ok=True)
        async with self.q:
            async with self.q.connection() as conn:
                await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(SCHEMA)))
            await self.q.install()
            procs = [_spawn(env, a) for _ in range(a.workers)]
            self.stop_pin = asyncio.Event()
            producer = asyncio.create_task(self.produce())
            pressure: list[asyncio.Task[None]] = []
            try:
                t0 = time.monotonic()
                ends = {"warm": a.warm, "pinned": a.warm + a.pin,
                        "after": a.warm + a.pin + a.after}
                while True:
                    await asyncio.sleep(a.window)
                    el = time.monotonic() - t0
                    if self.phase == "warm" and el >= ends["warm"]:
                        self.phase = "pinned"
                        pressure = ([asyncio.create_task(self.hold_idle())]
                                    if a.pressure == "idle" else
                                    [asyncio.create_task(self.reader(i * 7.5))
                                     for i in range(4)])
                    elif self.phase == "pinned" and el >= ends["pinned"]:
                        if a.history:
                            self.pruned = await self.prunes()
                            print(json.dumps(self.pruned), flush=True)
                        self.stop_pin.set()
                        await asyncio.gather(*pressure)
                        self.phase = "after"
                    elif self.phase == "after" and el >= ends["after"]:
                        break
                    s = await self.sample()
                    self.samples.append(s)
                    print(json.dumps(s), flush=True)
            finally:
                self.stop.set()
                self.stop_pin.set()
                await producer
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(30)
        await asyncio.sleep(1.5)  # the timing threads' last flush

    def report(self) -> dict[str, Any]:
        a = self.a
        timings = [tuple(map(float, line.split())) for line in
                   self.timings.read_text().splitlines()] if self.timings.exists() else []
        self.timings.unlink(missing_ok=True)
        out: dict[str, Any] = {"args": vars(a), "phases": {}}
        if a.history:
            out["history"] = [{k: x[k] for k in ("t", "phase", "history_size", "counts_size",
                                                 "counts_dead", "stats_ms", "list_done_ms",
                                                 "count_ms", "throughput_ms")}
                              for x in self.samples]
            out["pruned_at_pin_end"] = getattr(self, "pruned", None)
        s = self.samples
        for phase in ("warm", "pinned", "after"):
            ps = [x for x in s if x["phase"] == phase]
            if len(ps) < 2:
                continue
            # The first window of a phase started in the previous one.
            first, last = ps[0], ps[-1]
            rate = (last["done"] - first["done"]) / (last["t"] - first["t"])
            ms = sorted(d * 1000 for t, d in timings if first["t"] <= t <= last["t"])
            q = statistics.quantiles(ms, n=100) if len(ms) >= 100 else [float("nan")] * 99
            out["phases"][phase] = {
                "throughput": round(rate, 1), "offered": a.rate,
                "of_offered": round(rate / a.rate, 4),
                "backlog_max": max(x["queued"] for x in ps),
                "backlog_end": last["queued"],
                "claim_ms_p50": round(statistics.median(ms), 3) if ms else None,
                "claim_ms_p99": round(q[98], 3), "claims": len(ms),
                "size_bytes_end": last["size"], "dead_end": last["dead"],
                "size_bytes_max": max(x["size"] for x in ps),
            }
        pinned = [x for x in s if x["phase"] == "pinned"]
        if pinned:
            start = pinned[0]["t"]
            out["pinned_sizes"] = [[round(x["t"] - start), x["size"], x["dead"]]
                                   for x in pinned]
            # A long pin: the claim's times minute by minute (is the last like the first?).
            minutes: dict[int, list[float]] = {}
            for t, d in timings:
                if start <= t <= pinned[-1]["t"]:
                    minutes.setdefault(int((t - start) // 60), []).append(d * 1000)
            out["pinned_minutes"] = [
                [m, round(statistics.median(v), 3),
                 round(statistics.quantiles(v, n=100)[98], 3) if len(v) >= 100 else None,
                 len(v)] for m, v in sorted(minutes.items())]
        return out


def _spawn(env: dict[str, str], a: argparse.Namespace) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "asyncjobq", "worker", "benchmarks.pinned:queue",
         "--log-level", "warning", "--concurrency", str(a.concurrency), "--batch", str(a.batch)],
        cwd=HERE.parent, env=env)


def summary(label: str) -> str:
    """A Markdown table of the runs labelled `label`-r<n>: per cell, medians of the runs."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for path in sorted(RESULTS.glob(f"pinned-*-{label}-r*.json")):
        run = json.loads(path.read_text())
        a = run["args"]
        cells.setdefault((a["pressure"], a["rate"]), []).append(run)
    lines = [
        "| pressure | jobs/s offered | runs | during the pin, of offered | backlog max (jobs) |"
        " claim p50 clean -> pinned (ms) | claim p99 clean -> pinned (ms) | p99 ratio |"
        " `jobs` size at the pin's end (MB) | dead rows at its end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (pressure, rate), runs in sorted(cells.items()):
        def med(phase: str, key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r["phases"][phase][key] for r in runs)
        ratio = statistics.median(r["phases"]["pinned"]["claim_ms_p99"]
                                  / r["phases"]["warm"]["claim_ms_p99"] for r in runs)
        lines.append(
            f"| {pressure} | {rate:,} | {len(runs)} | {med('pinned', 'of_offered'):.1%} |"
            f" {med('pinned', 'backlog_max'):,.0f} |"
            f" {med('warm', 'claim_ms_p50'):.2f} -> {med('pinned', 'claim_ms_p50'):.2f} |"
            f" {med('warm', 'claim_ms_p99'):.1f} -> {med('pinned', 'claim_ms_p99'):.1f} |"
            f" {ratio:.1f}x | {med('pinned', 'size_bytes_end') / 1e6:.1f} |"
            f" {med('pinned', 'dead_end'):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:
        print(summary(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--pressure", choices=["idle", "readers", "scanners"], default="idle")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--warm", type=float, default=30)
    p.add_argument("--pin", type=float, default=120)
    p.add_argument("--after", type=float, default=20)
    p.add_argument("--window", type=float, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--no-leader-vacuum", action="store_true",
                   help="the workers' leader does not vacuum jobs (autovacuum still may)")
    p.add_argument("--history", action="store_true",
                   help="also sample history's size, the read calls' times, and prune at the "
                        "pin's end")
    a = p.parse_args()
    from benchmarks.common import start_server
    server = start_server()
    try:
        run = Run(server.dsn, a)
        asyncio.run(run.run())
        out = run.report()
        out["server"] = server.info
    finally:
        server.stop()
    RESULTS.mkdir(exist_ok=True)
    name = f"pinned-{a.pressure}-{a.rate}{'-' + a.label if a.label else ''}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["phases"], indent=1))


if __name__ == "__main__":
    main()
