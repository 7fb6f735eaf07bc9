"""Soak: push N jobs (default 1,000,000) through at a steady rate with workers running, and watch
what the queue table does. Then pin the xmin horizon with an idle-in-transaction session while
jobs keep flowing, release it, and measure the recovery.

    .venv/bin/python benchmarks/soak.py                  # 1M jobs, 60 s pinned (about 12 min)
    .venv/bin/python benchmarks/soak.py --jobs 100000 --pin 15   # a quick look

Every `--sample-every` jobs it records the claim statement's real plan (EXPLAIN (ANALYZE,
BUFFERS) of the worker's claim, rolled back; median of 5), the hot table's and its indexes'
sizes, dead rows, and throughput. Writes benchmarks/results/SOAK.md, soak.json and soak.png.
Uses $ASYNCJOBQ_DSN when set, else its own embedded PostgreSQL in benchmarks/.pgdata.

This file is also the workers' APP (`soak:queue`): one zero-work task.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from asyncjobq import Job, Queue
from asyncjobq.doctor import explain_claim

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCHEMA = "soak"
DSN_ENV = "ASYNCJOBQ_SOAK_DSN"

queue = Queue(os.environ.get(DSN_ENV), schema=SCHEMA, pool_max_size=4)


@queue.task(name="noop")
async def noop(job: Job) -> None:
    pass


SIZES = sql.SQL(
    "SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid),"
    " pg_relation_size({s}::regclass),"
    " coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),"
    " coalesce(s.autovacuum_count, 0) + coalesce(s.vacuum_count, 0),"
    " pg_total_relation_size({h}::regclass)"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
    " WHERE c.oid = {j}::regclass"
)
COUNTS = sql.SQL("SELECT count(*), count(*) FILTER (WHERE status = 'queued') FROM {}.jobs")


def sizes_query() -> sql.Composed:
    return SIZES.format(s=sql.Literal(f"{SCHEMA}.jobs_dequeue_idx"),
                        h=sql.Literal(f"{SCHEMA}.jobs_history"), j=sql.Literal(f"{SCHEMA}.jobs"))


def counts_query() -> sql.Composed:
    return COUNTS.format(sql.Identifier(SCHEMA))


class Soak:
    def __init__(self, dsn: str, args: argparse.Namespace) -> None:
        self.dsn = dsn
        self.args = args
        self.q = Queue(dsn, schema=SCHEMA, pool_max_size=4)
        self.produced = 0
        self.samples: list[dict[str, Any]] = []
        self.windows: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.stop_producing = asyncio.Event()
        self.server_version = "?"

    async def produce(self) -> None:
        """A steady rate: `rate` jobs/s in chunks of 100, on an absolute schedule."""
        chunk = 100
        interval = chunk / self.args.rate
        next_at = time.monotonic()
        while not self.stop_producing.is_set():
            await self.q.enqueue_many("noop", [{}] * chunk)
            self.produced += chunk
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def counts(self) -> tuple[int, int, int]:
        created = self.produced  # counted after each enqueue_many committed
        async with self.q.connection() as conn:
            cur = await conn.execute(counts_query())
            live, queued = await cur.fetchone() or (0, 0)
        # Finished jobs leave the hot table, so processed = created - still in it.
        return created, created - int(live), int(queued)

    async def sample(self, phase: str, last: dict[str, Any] | None) -> dict[str, Any]:
        async with self.q.connection() as conn:
            # The article's measure is claiming one job; the worker's batch is 10.
            claims = [await explain_claim(conn, self.q.sql, "default", limit=1)
                      for _ in range(5)]
            batch = [await explain_claim(conn, self.q.sql, "default", limit=10)
                     for _ in range(5)]
            cur = await conn.execute(sizes_query())
            table, indexes, dequeue_idx, dead, live, autovacs, history = \
                await cur.fetchone() or (0,) * 7
        created, processed, queued = await self.counts()
        now = time.monotonic() - self.t0
        rate = None
        if last is not None and now > last["t"]:
            rate = (processed - last["processed"]) / (now - last["t"])
        return {
            "phase": phase, "t": round(now, 2), "created": created, "processed": processed,
            "queued": queued, "throughput": None if rate is None else round(rate, 1),
            "claim_ms": statistics.median(c["execution_ms"] for c in claims),
            "claim_blocks": statistics.median(c["blocks"] for c in claims),
            "claim_scan": f"{claims[0]['scan']} {claims[0]['index'] or ''}".strip(),
            "claim10_ms": statistics.median(c["execution_ms"] for c in batch),
            "claim10_blocks": statistics.median(c["blocks"] for c in batch),
            "jobs_bytes": int(table), "jobs_indexes_bytes": int(indexes),
            "dequeue_idx_bytes": int(dequeue_idx), "dead_tuples": int(dead),
            "live_tuples": int(live), "vacuums": int(autovacs),
            "history_bytes": int(history),
        }

    async def run(self) -> None:
        a = self.args
        async with self.q:
            async with self.q.connection() as conn:
                await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                    sql.Identifier(SCHEMA)))
            await self.q.install()
            workers = [spawn_worker(self.dsn, a) for _ in range(a.workers)]
            try:
                await self._phases()
            finally:
                for w in workers:
                    w.terminate()
                for w in workers:
                    try:
                        w.wait(30)
                    except subprocess.TimeoutExpired:
                        w.kill()

    async def _phases(self) -> None:
        a = self.args
        last = await self.sample("start", None)
        self.samples.append(last)
        print(fmt(last), flush=True)
        producer = asyncio.create_task(self.produce())
        next_mark = a.sample_every
        while True:
            await asyncio.sleep(0.5)
            _, processed, _ = await self.counts()
            if processed >= next_mark:
                last = await self.sample("soak", last)
                self.samples.append(last)
                print(fmt(last), flush=True)
                next_mark += a.sample_every
                if processed >= a.jobs:
                    break
            if producer.done():
                producer.result()
        # Pin the xmin horizon: an idle-in-transaction session that holds an xid.
        w = await self.sample("before pin", None)  # a window starts here; no rate yet
        self.windows.append(w)
        for _ in range(3):
            await asyncio.sleep(a.window)
            w = await self.sample("before pin", w)
            self.windows.append(w)
            print(fmt(w), flush=True)
        holder = await psycopg.AsyncConnection.connect(self.dsn, application_name="soak-pin")
        await holder.execute("SELECT txid_current()")
        pin_end = time.monotonic() + a.pin
        while time.monotonic() < pin_end:
            await asyncio.sleep(a.window)
            w = await self.sample("pinned", w)
            self.windows.append(w)
            print(fmt(w), flush=True)
        await holder.rollback()
        await holder.close()
        for _ in range(int(a.recover / a.window)):
            await asyncio.sleep(a.window)
            w = await self.sample("released", w)
            self.windows.append(w)
            print(fmt(w), flush=True)
        self.stop_producing.set()
        await producer


def spawn_worker(dsn: str, a: argparse.Namespace) -> subprocess.Popen[bytes]:
    env = {**os.environ, DSN_ENV: dsn}
    return subprocess.Popen(
        [sys.executable, "-m", "asyncjobq", "worker", "soak:queue", "--log-level", "warning",
         "--concurrency", str(a.concurrency), "--batch", str(a.batch)],
        cwd=HERE, env=env)


def fmt(s: dict[str, Any]) -> str:
    tp = "-" if s["throughput"] is None else f"{s['throughput']:.0f}/s"
    return (f"[{s['phase']:>10}] t={s['t']:7.1f}s processed={s['processed']:>8} "
            f"queued={s['queued']:>6} {tp:>8} claim {s['claim_blocks']:.0f} blocks "
            f"{s['claim_ms']:.3f} ms ({s['claim_scan']}) jobs {s['jobs_bytes'] // 1024} kB "
            f"idx {s['jobs_indexes_bytes'] // 1024} kB dead {s['dead_tuples']}")


def server_version(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"


def report(soak: Soak, dsn_label: str, elapsed: float) -> None:
    a = soak.args
    RESULTS.mkdir(exist_ok=True)
    s, w = soak.samples, soak.windows
    soaked = [x for x in s if x["phase"] == "soak"]
    # One sample catches the claim wherever it is between two vacuums: judge medians of 5.
    early, late = soaked[:5], soaked[-5:]
    final = s[-1]
    late_blocks = statistics.median(x["claim_blocks"] for x in late)
    early_ms = statistics.median(x["claim_ms"] for x in early)
    late_ms = statistics.median(x["claim_ms"] for x in late)
    ratio = late_ms / early_ms if early_ms else float("nan")
    worst = max(soaked, key=lambda x: x["claim_blocks"])
    base = statistics.median(x["throughput"] for x in w if x["phase"] == "before pin"
                             and x["throughput"] is not None)
    released = [x for x in w if x["phase"] == "released"]
    pin_t = next((x["t"] for x in w if x["phase"] == "released"), None)
    release_t = pin_t - a.window if pin_t is not None else None
    recovered = next((x for x in released if x["throughput"] is not None
                      and x["throughput"] >= 0.9 * base), None)
    recovery_s = (recovered["t"] - release_t) if recovered and release_t is not None else None
    pinned = [x for x in w if x["phase"] == "pinned"]
    half = a.jobs // 2
    size = [(x["processed"], x["jobs_bytes"] + x["jobs_indexes_bytes"]) for x in soaked]
    first_half = max((b for n, b in size if n <= half), default=0)
    second_half = max((b for n, b in size if n > half), default=0)
    end_size = size[-1][1] if size else 0
    after_pin = w[-1]["jobs_bytes"] + w[-1]["jobs_indexes_bytes"]
    lines = [
        "# Soak: 1,000,000 jobs through one queue table" if a.jobs == 1_000_000
        else f"# Soak: {a.jobs:,} jobs through one queue table",
        "",
        f"Command: `.venv/bin/python benchmarks/soak.py --jobs {a.jobs} --rate {a.rate} "
        f"--workers {a.workers} --pin {a.pin:g}`  ",
        f"PostgreSQL {soak.server_version} ({dsn_label}), Python "
        f"{platform.python_version()}, psycopg {psycopg.__version__}, {os.cpu_count()} CPUs, "
        f"{platform.machine()}; run took {elapsed:.0f} s.  ",
        f"{a.workers} worker processes (`--concurrency {a.concurrency} --batch {a.batch}`), "
        f"zero-work jobs, offered at {a.rate} jobs/s in `enqueue_many` chunks of 100. The claim "
        "is the worker's own statement, prepared and run with its generic plan as workers run "
        "it, under `EXPLAIN (ANALYZE, BUFFERS)` in a rolled-back transaction, median of 5 "
        "per sample, with limit 1 (the article's measure: claiming one job) and limit 10 "
        "(the worker's batch); blocks are shared hit + read of every "
        "read of `jobs_dequeue_idx` in the plan (index pages, plus heap pages of rows it visits).",
        "",
        "## Targets",
        "",
        "| target | figure | reached |",
        "|---|---|---|",
        f"| claim touches < 10 index blocks at {final['processed']:,} jobs | median of the last "
        f"5 samples {late_blocks:g} blocks (last sample {final['claim_blocks']:g}; worst of the "
        f"soak {worst['claim_blocks']:g} at {worst['processed']:,}) | "
        f"{'yes' if late_blocks < 10 else 'no'} |",
        f"| claim time ≤ 1.2× the start | median of the last 5 samples {late_ms:.3f} ms vs the "
        f"first 5 {early_ms:.3f} ms = {ratio:.2f}× (at 0 jobs: {s[0]['claim_ms']:.3f} ms) | "
        f"{'yes' if ratio <= 1.2 else 'no'} |",
        f"| hot table + indexes bounded (second half of the soak no larger than the first, "
        f"within 10 %) | table + indexes: largest {first_half / 1024:.0f} kB up to "
        f"{half:,} jobs, {second_half / 1024:.0f} kB after; at the end {end_size / 1024:.0f} kB | "
        f"{'yes' if second_half <= 1.1 * first_half else 'no'} |",
        f"| throughput ≥ 90 % of before within 60 s of release | before {base:.0f}/s; "
        + (f"first window ≥ {0.9 * base:.0f}/s ends {recovery_s:.0f} s after release"
           if recovery_s is not None else "not within the run")
        + f" | {'yes' if recovery_s is not None and recovery_s <= 60 else 'no'} |",
        "",
        f"While the xmin horizon was pinned, vacuum could remove nothing: the claim read up to "
        f"{max((x['claim_blocks'] for x in pinned), default=0):g} blocks "
        f"({max((x['claim_ms'] for x in pinned), default=0):.1f} ms) and throughput fell to "
        f"{min((x['throughput'] or 0 for x in pinned), default=0):.0f}/s — the article's "
        "effect, which asyncjobq cannot prevent, only report (`doctor`) and recover from. "
        f"After it the hot table shrank back (vacuum truncates it) but its indexes keep the "
        f"pages they grew to (B-tree pages are reused, not returned): table + indexes "
        f"{after_pin / 1024:.0f} kB at the end of the run.",
        "",
        f"## Every {a.sample_every:,} jobs",
        "",
        "| jobs processed | t (s) | jobs/s | queued | claim blocks | claim ms | claim(10) blocks"
        " | claim(10) ms | plan | jobs kB | indexes kB | dequeue idx kB | dead rows |"
        " vacuums | history MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for x in s:
        lines.append(
            f"| {x['processed']:,} | {x['t']:.0f} | {x['throughput'] or 0:.0f} | {x['queued']} | "
            f"{x['claim_blocks']:.0f} | {x['claim_ms']:.3f} | {x['claim10_blocks']:.0f} | "
            f"{x['claim10_ms']:.3f} | {x['claim_scan']} | "
            f"{x['jobs_bytes'] // 1024} | {x['jobs_indexes_bytes'] // 1024} | "
            f"{x['dequeue_idx_bytes'] // 1024} | {x['dead_tuples']} | {x['vacuums']} | "
            f"{x['history_bytes'] / 1e6:.0f} |")
    lines += [
        "",
        f"## Idle in transaction for {a.pin:g} s, then released ({a.window:g} s windows)",
        "",
        "| phase | t (s) | jobs/s | queued | claim blocks | claim ms | jobs kB | indexes kB |"
        " dead rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in w:
        lines.append(
            f"| {x['phase']} | {x['t']:.0f} | {x['throughput'] or 0:.0f} | {x['queued']} | "
            f"{x['claim_blocks']:.0f} | {x['claim_ms']:.3f} | {x['jobs_bytes'] // 1024} | "
            f"{x['jobs_indexes_bytes'] // 1024} | {x['dead_tuples']} |")
    lines += ["", "![soak](soak.png)", ""]
    (RESULTS / "SOAK.md").write_text("\n".join(lines))
    (RESULTS / "soak.json").write_text(json.dumps(
        {"samples": s, "windows": w, "args": vars(a), "label": dsn_label, "elapsed": elapsed,
         "server": soak.server_version}, indent=1))
    plot(s, w, release_t, a)
    print("\n".join(lines[:16]))


def plot(s: list[dict[str, Any]], w: list[dict[str, Any]], release_t: float | None,
         a: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no soak.png")
        return
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10))
    xs = [x["processed"] / 1000 for x in s]
    ax1.plot(xs, [x["claim_blocks"] for x in s], "o-", label="claim blocks")
    ax1b = ax1.twinx()
    ax1b.plot(xs, [x["claim_ms"] for x in s], "s--", color="tab:red", label="claim ms")
    ax1.set_xlabel("jobs processed (thousands)")
    ax1.set_ylabel("blocks (hit + read)")
    ax1b.set_ylabel("ms")
    ax1.set_title("The claim over the soak")
    ax1.legend(loc="upper left")
    ax1b.legend(loc="upper right")
    ax2.plot(xs, [x["jobs_bytes"] / 1024 for x in s], "o-", label="jobs table kB")
    ax2.plot(xs, [x["jobs_indexes_bytes"] / 1024 for x in s], "s-", label="jobs indexes kB")
    ax2.plot(xs, [x["dead_tuples"] / 10 for x in s], "^:", label="dead rows / 10")
    ax2.set_xlabel("jobs processed (thousands)")
    ax2.set_title("Hot table size")
    ax2.legend()
    t0 = w[0]["t"]
    ts = [x["t"] - t0 for x in w]
    rated = [(t, x["throughput"]) for t, x in zip(ts, w, strict=True)
             if x["throughput"] is not None]
    ax3.plot([t for t, _ in rated], [r for _, r in rated], "o-", label="jobs/s")
    ax3b = ax3.twinx()
    ax3b.plot(ts, [x["claim_blocks"] for x in w], "s--", color="tab:red", label="claim blocks")
    pinned = [x["t"] - t0 for x in w if x["phase"] == "pinned"]
    if pinned and release_t is not None:
        ax3.axvspan(pinned[0] - a.window, release_t - t0, color="0.9", label="xmin pinned")
    ax3.set_xlabel("seconds")
    ax3.set_ylabel("jobs/s")
    ax3b.set_ylabel("claim blocks")
    ax3.set_title(f"Idle in transaction for {a.pin:g} s")
    ax3.legend(loc="lower left")
    ax3b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--rate", type=int, default=2000, help="jobs/s offered")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--sample-every", type=int, default=50_000)
    p.add_argument("--pin", type=float, default=60.0, help="seconds idle in transaction")
    p.add_argument("--recover", type=float, default=60.0, help="seconds watched after")
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite SOAK.md and soak.png from results/soak.json")
    a = p.parse_args()
    if a.report_only:
        saved = json.loads((RESULTS / "soak.json").read_text())
        a = argparse.Namespace(**{**vars(a), **saved.get("args", {})})
        soak = Soak("", a)
        soak.samples, soak.windows = saved["samples"], saved["windows"]
        soak.server_version = saved.get("server", "16.2")
        report(soak, saved.get("label", "embedded pgserver"), saved.get("elapsed", 0.0))
        return
    dsn = os.environ.get("ASYNCJOBQ_DSN")
    label = "$ASYNCJOBQ_DSN"
    server = None
    if not dsn:
        from asyncjobq._db.embedded import start_pgserver

        server = start_pgserver(HERE / ".pgdata", cleanup_mode="stop")
        dsn, label = str(server.get_uri()), "embedded pgserver"
    soak = Soak(dsn, a)
    soak.server_version = server_version(dsn)
    t = time.monotonic()
    try:
        asyncio.run(soak.run())
        report(soak, label, time.monotonic() - t)
    finally:
        if server is not None:
            server.cleanup()


if __name__ == "__main__":
    main()
