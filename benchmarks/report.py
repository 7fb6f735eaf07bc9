"""Writes RESULTS.md and the PNG plots from one run's results (results.json)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import RESULTS

Raw = dict[str, list[dict[str, Any]]]


def outdir(data: dict[str, Any]) -> Path:
    return RESULTS / "quick" if data.get("mode") == "quick" else RESULTS


class R:
    def __init__(self, raw: Raw) -> None:
        self.raw = raw

    def has(self, name: str) -> bool:
        return bool(self.raw.get(name))

    def vals(self, name: str, field: str) -> list[float]:
        return [float(r[field]) for r in self.raw.get(name, []) if r.get(field) is not None]

    def med(self, name: str, field: str = "jobs_per_s") -> float:
        v = self.vals(name, field)
        return statistics.median(v) if v else float("nan")

    def spread(self, name: str, field: str = "jobs_per_s", fmt: str = "{:,.0f}") -> str:
        v = self.vals(name, field)
        if not v:
            return "—"
        return f"{fmt.format(min(v))}–{fmt.format(max(v))}"

    def total(self, name: str, field: str) -> int:
        return int(sum(self.vals(name, field)))


def n0(x: float) -> str:
    return "—" if x != x else f"{x:,.0f}"


def n2(x: float) -> str:
    return "—" if x != x else f"{x:.2f}"


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def best_ceiling(r: R, s: dict[str, Any], batch: int) -> tuple[float, str]:
    best, where = float("nan"), "—"
    for c in s["ceiling_clients"]:
        v = r.med(f"ceiling b={batch} c={c}")
        if v == v and not (best == best and best >= v):
            best, where = v, f"{c} clients"
    return best, where


def render(data: dict[str, Any]) -> None:
    out = outdir(data)
    out.mkdir(parents=True, exist_ok=True)
    r = R(data["raw"])
    s = data["settings"]
    cmd = data["command"].replace("python -m", ".venv/bin/python -m")
    md: list[str] = []
    targets: list[list[str]] = []

    def target(what: str, figure: str, ok: bool | None) -> None:
        targets.append([what, figure, "—" if ok is None else ("**reached**" if ok
                                                             else "**not reached**")])

    md.append("# asyncjobq benchmarks\n")
    md.append(f"Produced by `{cmd}` (`make bench{'-quick' if data['mode'] == 'quick' else ''}`)"
              f" on {data['started']}, {data['duration_s'] / 60:.1f} min. Every cell ran "
              f"**{s['rounds']} rounds, interleaved** (all cells once per round, same order "
              "each round); figures are the **median** of the rounds, with the min–max "
              "spread beside. Ratios are between medians of this one run. Rerun with the "
              "command above; `--render` rewrites this file and the plots from "
              "`results.json`.\n")
    md.append("## Machine, server, versions\n")
    rows = [[k, f"`{v}`"] for k, v in data["machine"].items()]
    srv = data["server"]
    rows += [[f"PostgreSQL {k}", f"`{v}`"] for k, v in srv.items() if k != "pgbench"]
    rows += [[k, f"`{v}`"] for k, v in data["versions"].items()]
    if data.get("redis"):
        rows += [["Redis", f"`{data['redis']['url']}` ({data['redis']['persistence']})"]]
    md.append(table(["", ""], rows) + "\n")
    md.append("PostgreSQL runs with its defaults (fsync on, synchronous_commit on); "
              "shared_buffers is in 8 kB pages. The benchmark processes, the workers and "
              "the server share the machine's cores; nothing is pinned.\n")

    placeholder = len(md)
    md.append("")  # the targets table goes here

    # 1. ceiling -----------------------------------------------------------------------------
    if any(r.has(f"ceiling b={b} c={c}") for b in s["ceiling_batches"]
           for c in s["ceiling_clients"]):
        md.append("## 1. Ceiling: pgbench running the article's loop\n")
        md.append("Each pgbench transaction is the article's worker loop for one batch: the "
                  "claim `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED) "
                  "RETURNING id`, then `UPDATE ... SET status = 'done' WHERE id = ANY(ids)`, "
                  "two statements, two commits, on the article's table (its columns, "
                  "`status text`, the partial index `(queue, priority DESC, run_at, id) WHERE "
                  "status = 'queued'`; done rows stay in the table). "
                  f"`pgbench -n -M simple -c C -j C -T {s['pgbench_seconds']}`, table "
                  "refilled, VACUUM ANALYZE and CHECKPOINT before every cell. Jobs/s = done "
                  "rows / duration. Script: `benchmarks/ceiling.py`.\n")
        head = ["batch"] + [f"{c} client{'s' if c > 1 else ''}" for c in s["ceiling_clients"]]
        head += ["best", "article (4 processes)"]
        article = {1: "1,430", 10: "10,842", 50: "26,726"}
        rows = []
        for b in s["ceiling_batches"]:
            best, where = best_ceiling(r, s, b)
            rows.append([str(b)] + [f"{n0(r.med(f'ceiling b={b} c={c}'))} "
                                    f"<sub>({r.spread(f'ceiling b={b} c={c}')})</sub>"
                                    for c in s["ceiling_clients"]]
                        + [f"**{n0(best)}** ({where})", article.get(b, "—")])
        md.append(table(head, rows) + "\n")

    # 2. drain -------------------------------------------------------------------------------
    drain_names = [k for k in data["raw"] if k.startswith("drain ")]
    if drain_names:
        md.append("## 2. asyncjobq drain: zero-work jobs\n")
        md.append(f"{s['drain_jobs']:,} zero-work jobs enqueued (enqueue_many), VACUUM "
                  "ANALYZE, CHECKPOINT; then worker processes (`benchmarks/worker_proc.py`: "
                  "an `asyncjobq.Worker`, one async task that only records `job.id`) start, "
                  "open their pools, and are released together. Time runs from the release to "
                  "the last completion's `finished_at`. Concurrency is the default 20, or "
                  "2 × batch when that is larger. Double claims: jobs executed more than once "
                  "(summed over all rounds). CPU: the worker processes' user+sys time per "
                  "job. Ratio: to the best ceiling cell at the same batch size.\n")
        rows = []
        for name in drain_names:
            label = name.removeprefix("drain ")
            if label.startswith("default"):
                batch = 10
                label = "default settings (concurrency 20, batch 10), 1 process"
            else:
                parts = dict(x.split("=") for x in label.split())
                batch = int(parts["b"])
                conc = max(20, 2 * batch)
                label = (f"{parts['p']} process{'es' if parts['p'] != '1' else ''}, "
                         f"batch {batch}, concurrency {conc}")
            best, _ = best_ceiling(r, s, batch)
            v = r.med(name)
            cpu = r.med(name, "worker_cpu_s") / s["drain_jobs"] * 1e6
            rows.append([label, f"**{n0(v)}**", r.spread(name), n2(v / best) + "×",
                         f"{n0(best)}", str(r.total(name, "double_claims")), f"{cpu:.0f} µs",
                         f"{r.med(name, 'maxrss_mb'):.0f} MB"])
        md.append(table(["workers", "jobs/s", "spread", "ratio to ceiling", "ceiling (same batch)",
                         "double claims", "worker CPU/job", "peak RSS"], rows) + "\n")
        d = "drain default p=1"
        b50, _ = best_ceiling(r, s, 50)
        b10, _ = best_ceiling(r, s, 10)
        if r.has(d) and b50 == b50:
            target("default worker ≥ 1.0× ceiling at batch 50",
                   f"{n0(r.med(d))} / {n0(b50)} = {n2(r.med(d) / b50)}×", r.med(d) >= b50)
        if r.has("drain p=1 b=50") and b50 == b50:
            v = r.med("drain p=1 b=50")
            target("1 process `--batch 50` ≥ 1.0× ceiling at batch 50",
                   f"{n0(v)} / {n0(b50)} = {n2(v / b50)}×", v >= b50)
        if r.has("drain p=1 b=10") and b10 == b10:
            v = r.med("drain p=1 b=10")
            target("1 process `--batch 10` ≥ 1.0× ceiling at batch 10",
                   f"{n0(v)} / {n0(b10)} = {n2(v / b10)}×", v >= b10)
        dc = sum(r.total(n, "double_claims") for n in drain_names)
        target("double claims in every drain", str(dc), dc == 0)

    # 3. I/O ---------------------------------------------------------------------------------
    io_names = [k for k in data["raw"] if k.startswith("io ")]
    if io_names:
        md.append("## 3. I/O-bound jobs: 5 ms `await asyncio.sleep` per job, one process\n")
        md.append(f"{s['io_jobs']:,} jobs, drained as in 2. The article: 614 jobs/s with 8 "
                  "processes. A handler's 5 ms cap one slot at 200 jobs/s, so concurrency C "
                  "caps the process at 200·C jobs/s.\n")
        rows = []
        for name in io_names:
            parts = dict(x.split("=") for x in name.removeprefix("io ").split())
            cap = 200 * int(parts["c"])
            rows.append([parts["c"], parts["b"], f"**{n0(r.med(name))}**", r.spread(name),
                         n0(cap), str(r.total(name, "double_claims"))])
        md.append(table(["concurrency", "batch", "jobs/s", "spread", "sleep-bound cap",
                         "double claims"], rows) + "\n")
        for name in io_names:
            if "c=200" in name:
                v = r.med(name)
                target(f"I/O-bound 5 ms, {name.removeprefix('io ')} ≥ 10,000 jobs/s",
                       n0(v), v >= 10_000)

    # 4. locks -------------------------------------------------------------------------------
    lock_names = [k for k in data["raw"] if k.startswith("locks ")]
    if lock_names:
        md.append("## 4. The article's lock experiment\n")
        md.append(f"{s['lock_jobs']:,} jobs on the article's table; each worker (its own "
                  "process and connection) runs the naive loop one job at a time: SELECT the "
                  "next queued id (no lock / `FOR UPDATE` / `FOR UPDATE SKIP LOCKED`), UPDATE "
                  "it to running, commit, log an execution row, mark it done. Double-claimed: "
                  "jobs with more than one execution (median over rounds). The article: 3,616 "
                  "of 5,000 double-claimed without a lock. Script: `benchmarks/locks.py`.\n")
        rows = []
        for name in lock_names:
            _, lock, w = name.split()
            rows.append([lock.replace("_", " "), w.removeprefix("w="),
                         n0(r.med(name, "double_claimed")),
                         r.spread(name, "double_claimed"),
                         n0(r.med(name, "executions")), f"**{n0(r.med(name))}**"])
        md.append(table(["lock", "workers", f"double-claimed of {s['lock_jobs']:,}", "spread",
                         "executions", "jobs/s"], rows) + "\n")

    # 5. enqueue -----------------------------------------------------------------------------
    if r.has("enqueue() x1"):
        md.append("## 5. Enqueue\n")
        md.append("Into asyncjobq's own jobs table in a fresh schema, so pgbench's INSERTs fire "
                  "the same statement-level NOTIFY trigger and maintain the same indexes "
                  "(notifications on). `enqueue()` from 1 coroutine "
                  f"({s['enqueue_one']:,} jobs) and from 50 concurrent coroutines "
                  f"({2 * s['enqueue_one']:,} jobs) on one `Queue` (default pool, 10 "
                  "connections); `enqueue_many` of "
                  f"{s['enqueue_many']:,} in one call and as 100-job calls. pgbench: "
                  f"`-T {s['pgbench_seconds']}` single-row `INSERT ... VALUES` and "
                  "`INSERT ... SELECT FROM generate_series(1, 100)`.\n")
        p1, p4, p100 = (r.med("pgbench insert 1 row c=1", "rows_per_s"),
                        r.med("pgbench insert 1 row c=4", "rows_per_s"),
                        r.med("pgbench insert 100 rows c=1", "rows_per_s"))
        rows = [
            ["pgbench INSERT 1 row, 1 client", n0(p1),
             r.spread("pgbench insert 1 row c=1", "rows_per_s"), ""],
            ["pgbench INSERT 1 row, 4 clients", n0(p4),
             r.spread("pgbench insert 1 row c=4", "rows_per_s"), ""],
            ["pgbench INSERT 100 rows, 1 client", n0(p100),
             r.spread("pgbench insert 100 rows c=1", "rows_per_s"), ""],
        ]
        for name, ref, refname in [
            ("enqueue() x1", p1, "1-row, 1 client"),
            ("enqueue() x50", p4, "1-row, 4 clients"),
            ("enqueue_many(10000)", p100, "100-row"),
            ("enqueue_many(100) x100", p100, "100-row"),
        ]:
            v = r.med(name, "rows_per_s")
            rows.append([f"asyncjobq {name}", f"**{n0(v)}**", r.spread(name, "rows_per_s"),
                         f"{n2(v / ref)}× pgbench {refname}"])
        md.append(table(["", "jobs/s", "spread", "ratio"], rows) + "\n")
        v = r.med("enqueue_many(10000)", "rows_per_s")
        target("enqueue_many(10,000) ≥ 0.8× pgbench 100-row INSERT",
               f"{n2(v / p100)}×", v / p100 >= 0.8)
        v = r.med("enqueue_many(100) x100", "rows_per_s")
        target("enqueue_many in 100-job calls ≥ 0.8× pgbench 100-row INSERT",
               f"{n2(v / p100)}×", v / p100 >= 0.8)
        v = r.med("enqueue() x50", "rows_per_s")
        target("concurrent enqueue() (50 coroutines) ≥ 0.8× pgbench 1-row at 4 clients",
               f"{n2(v / p4)}×", v / p4 >= 0.8)

    # 6. latency -----------------------------------------------------------------------------
    if r.has("latency listen"):
        md.append("## 6. Latency: enqueue() → handler start, idle worker\n")
        md.append(f"{s['latency_jobs']:,} jobs per round, one at a time 5 ms apart, to one "
                  "default worker process; CLOCK_MONOTONIC stamped before the enqueue() call, "
                  "read at handler entry (so it includes the enqueue's commit). Poll only: "
                  "`listen=False`, poll_interval 1 s (the default). The article: 0.52 ms "
                  "median NOTIFY wake-up.\n")
        rows = []
        for name in ("latency listen", "latency poll only"):
            if r.has(name):
                rows.append([name.removeprefix("latency "),
                             *[f"{r.med(name, k):.2f} ms" for k in
                               ("p50_ms", "p95_ms", "p99_ms", "max_ms")]])
        md.append(table(["wake-up", "p50", "p95", "p99", "max"], rows) + "\n")
        p50, p99 = r.med("latency listen", "p50_ms"), r.med("latency listen", "p99_ms")
        target("latency with LISTEN: p50 < 2 ms", f"{p50:.2f} ms", p50 < 2)
        target("latency with LISTEN: p99 < 10 ms", f"{p99:.2f} ms", p99 < 10)

    # 7. Redis -------------------------------------------------------------------------------
    redis_names = [k for k in data["raw"] if k.startswith("redis ")]
    if redis_names:
        md.append("## 7. Redis, as the article compared it\n")
        md.append(f"{s['redis_jobs']:,} zero-work jobs, {s['redis_workers']} worker processes "
                  "(redis-py, one job at a time): reliable queue `LMOVE jobs processing:<w>` "
                  "then `LREM`; Streams `XREADGROUP COUNT 1` then `XACK`. asyncjobq figures "
                  "are from section 2 of this run. Script: `benchmarks/redis_cmp.py`.\n")
        rows = []
        ajq = [("asyncjobq default, 1 process", "drain default p=1"),
               (f"asyncjobq batch 10, {max(s['drain_procs'])} processes",
                f"drain p={max(s['drain_procs'])} b=10")]
        for name in redis_names:
            v = r.med(name)
            ratios = " · ".join(f"{label}: {n2(r.med(key) / v)}×" for label, key in ajq
                                if r.has(key))
            rows.append([name.removeprefix("redis ").replace("w=", "workers "),
                         f"**{n0(v)}**", r.spread(name), ratios])
        md.append(table(["Redis", "jobs/s", "spread", "asyncjobq / Redis"], rows) + "\n")
        lm = f"redis lmove w={s['redis_workers']}"
        if r.has(lm) and r.has("drain default p=1"):
            v = r.med("drain default p=1") / r.med(lm)
            target("asyncjobq default ≥ 1.0× Redis LMOVE one at a time", f"{n2(v)}×", v >= 1)

    # 8. memory ------------------------------------------------------------------------------
    mem_names = [k for k in data["raw"] if k.startswith("memory ")]
    if mem_names:
        md.append("## 8. Memory: worker peak RSS\n")
        md.append("One default worker process drains the backlog (the handler records "
                  "nothing); peak RSS is the process's ru_maxrss.\n")
        rows = [[f"{int(n.split()[1]):,} jobs", f"**{r.med(n, 'maxrss_mb'):.1f} MB**",
                 r.spread(n, "maxrss_mb", "{:.1f}"), n0(r.med(n))] for n in mem_names]
        md.append(table(["backlog", "peak RSS", "spread", "jobs/s"], rows) + "\n")
        if len(mem_names) == 2:
            a, b = (r.med(n, "maxrss_mb") for n in mem_names)
            growth = (b - a) / a * 100
            target(f"worker RSS flat within 10 % ({mem_names[0].split()[1]} → "
                   f"{mem_names[1].split()[1]} jobs)", f"{a:.1f} → {b:.1f} MB ({growth:+.1f} %)",
                   abs(growth) <= 10)
            target("worker RSS < 100 MB", f"{max(a, b):.1f} MB", max(a, b) < 100)

    if targets:
        md[placeholder] = ("## Targets (issue 3), from this run\n\n"
                           + table(["target", "figure", ""], targets) + "\n")
    notes = out / "ANALYSIS.md"
    if notes.exists():
        md.append(notes.read_text())
    prof = out / "PROFILE.md"
    if prof.exists():
        md.append("## Profile\n")
        md.append(f"See [PROFILE.md]({prof.name}).\n")
    md.append("## Plots\n")
    for png in plots(data, r, out):
        md.append(f"![{png}]({png})\n")
    (out / "RESULTS.md").write_text("\n".join(md))


def plots(data: dict[str, Any], r: R, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    s = data["settings"]
    made: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    if r.has("ceiling b=10 c=1") or r.has("drain p=1 b=10"):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        batches = s["ceiling_batches"]
        series: list[tuple[str, Callable[[int], float]]] = [
            ("pgbench ceiling (best clients)", lambda b: best_ceiling(r, s, b)[0])]
        for p in s["drain_procs"]:
            series.append((f"asyncjobq {p} process{'es' if p > 1 else ''}",
                           lambda b, p=p: r.med(f"drain p={p} b={b}")))
        width = 0.8 / len(series)
        for i, (label, f) in enumerate(series):
            ax.bar([j + i * width for j in range(len(batches))], [f(b) for b in batches],
                   width, label=label)
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel("jobs/s (median)")
        ax.set_title("Zero-work drain vs the article's loop in pgbench")
        ax.legend()
        save(fig, "throughput.png")
    if r.has("latency listen"):
        fig, ax = plt.subplots(figsize=(6, 4))
        ks = ["p50_ms", "p95_ms", "p99_ms"]
        for i, name in enumerate(("latency listen", "latency poll only")):
            if r.has(name):
                ax.bar([j + i * 0.4 for j in range(3)], [r.med(name, k) for k in ks], 0.4,
                       label=name.removeprefix("latency "))
        ax.set_yscale("log")
        ax.set_xticks([j + 0.2 for j in range(3)], ["p50", "p95", "p99"])
        ax.set_ylabel("enqueue → handler start (ms, log)")
        ax.legend()
        save(fig, "latency.png")
    mem_names = [k for k in data["raw"] if k.startswith("memory ")]
    if mem_names:
        fig, ax = plt.subplots(figsize=(7, 4))
        for n in mem_names:
            samples = data["raw"][n][0].get("rss_samples_mb") or []
            ax.plot([i * 0.5 for i in range(len(samples))], samples,
                    label=f"{int(n.split()[1]):,} jobs")
        ax.set_xlabel("s since release (round 1)")
        ax.set_ylabel("worker RSS (MB)")
        ax.set_ylim(bottom=0)
        ax.legend()
        save(fig, "memory.png")
    lock_names = [k for k in data["raw"] if k.startswith("locks ")]
    if lock_names:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(range(len(lock_names)), [r.med(n, "double_claimed") for n in lock_names])
        ax.set_xticks(range(len(lock_names)),
                      [n.removeprefix("locks ").replace(" ", "\n") for n in lock_names])
        ax.set_ylabel(f"jobs double-claimed of {s['lock_jobs']:,}")
        save(fig, "locks.png")
    return made
