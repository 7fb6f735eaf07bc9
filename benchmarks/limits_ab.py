"""A/B of the drain (or the enqueue) of this tree against older commits, in the same run,
alternating, medians of 3; written for the cost of flow control (issue 21), its cells:

- before: the commit before flow control (a git worktree of --base): its worker, its schema;
- after: this tree, a worker whose tasks have no limits (it runs the claim statements it ran
  before; the schema has version 7's columns);
- after, limited claim: this tree, a worker that also registers a limited task, so that every
  claim goes through the limited statement (sql/claim.py) although no job has a limit;
- after, limited task on exports: this tree, a worker of `default` in an app whose limited
  task runs on another queue, `exports`: it must claim as a worker without limits does;
- after, handler returns a result: this tree, the handler returns a small dict, stored as the
  job's result (docs/guides/results.md): the cost of results against a handler returning None.
- article loop: ceiling.py's two statements through pgbench over the same number of jobs
  (`loop`): every cell's server CPU per job is also given against it.

`--enqueue one:50` (MODE:COROUTINES, benchmarks/enqueue.py) enqueues --jobs jobs instead; its
"worker CPU" is then the producer process's, both CPUs over the timed enqueue alone.

Both trees run this tree's benchmarks/ (copied over the base worktree's), so that only src/
differs. Server CPU per job is the PostgreSQL processes' CPU from release to drained
(common.server_cpu_s): nothing else may use the server meanwhile.

    ASYNCJOBQ_DSN=postgresql://... .venv/bin/python -m benchmarks.limits_ab
        [--base d003a27[,2dcb233]] [--cells before,loop,after] [--jobs 50000] [--rounds 3]
        [--concurrency 100 --batch 50] [--sleep 0.005] [--enqueue one:50]

Each cell runs in a process of its tree (the worktree is made under /tmp, and removed).
Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import ceiling
from .common import ROOT, log, median, server_cpu_s, start_server

CELL = (
    "import json, sys\n"
    "from benchmarks.common import start_server\n"
    "from benchmarks.drain import drain\n"
    "server = start_server()\n"
    "try:\n"
    "    r = drain(server, 'bench_limits_ab', int(sys.argv[1]), 1, record='none',\n"
    "              concurrency=int(sys.argv[2]), batch=int(sys.argv[3]),\n"
    "              sleep=float(sys.argv[4]), extra=tuple(sys.argv[5:]))\n"
    "finally:\n"
    "    server.stop()\n"
    "print('RESULT ' + json.dumps(r))\n"
)


# Enqueue instead of a drain (--enqueue MODE:COROUTINES): benchmarks/enqueue.py's cell.
ENQUEUE_CELL = (
    "import json, sys\n"
    "from benchmarks.common import start_server\n"
    "from benchmarks.enqueue import asyncjobq_cell\n"
    "server = start_server()\n"
    "try:\n"
    "    r = asyncjobq_cell(server, sys.argv[2], int(sys.argv[1]), int(sys.argv[3]))\n"
    "finally:\n"
    "    server.stop()\n"
    "print('RESULT ' + json.dumps({'jobs_per_s': r['rows_per_s'], 'done': r['rows'],\n"
    "                              'worker_cpu_s': r['producer_cpu_s'],\n"
    "                              'server_cpu_s': r['server_cpu_s']}))\n"
)


def run_cell(tree: Path, jobs: int, extra: list[str], concurrency: int = 0,
             batch: int = 0, sleep: float = 0.0, enqueue: str = "") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    argv = ([sys.executable, "-c", ENQUEUE_CELL, str(jobs), *enqueue.split(":")] if enqueue
            else [sys.executable, "-c", CELL, str(jobs), str(concurrency), str(batch),
                  str(sleep), *extra])
    out = subprocess.run(argv, cwd=tree, env=env,
                         capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    raise RuntimeError(f"cell in {tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def run_loop(jobs: int, batch: int, clients: int) -> dict[str, Any]:
    """The article's loop (ceiling.py) run by pgbench over `jobs` rows, each client claiming
    and finishing `batch` at a time until all are done: its jobs/s and server CPU, measured
    as a drain's are."""
    server = start_server()
    try:
        ceiling.setup(server)
        ceiling.refill(server, jobs)
        per_client = -(-jobs // (batch * clients))
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
            f.write(ceiling.SCRIPT.format(s=ceiling.SCHEMA, n=batch))
        cpu0 = server_cpu_s()
        t0 = time.monotonic()
        subprocess.run([server.pgbench, "-n", "-M", "simple", "-c", str(clients), "-j",
                        str(clients), "-t", str(per_client), "-f", f.name, server.dsn],
                       check=True, capture_output=True, timeout=1800)
        elapsed = time.monotonic() - t0
        cpu1 = server_cpu_s()
        Path(f.name).unlink()
        with server.connect() as conn:
            row = conn.execute(f"SELECT count(*) FILTER (WHERE status = 'done')"
                               f" FROM {ceiling.SCHEMA}.jobs").fetchone()
        done = int(row[0]) if row else 0
        ceiling.teardown(server)
    finally:
        server.stop()
    return {"jobs_per_s": done / elapsed, "done": done, "worker_cpu_s": float("nan"),
            "server_cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="d003a27",
                   help="the commit before flow control; several, comma-separated, make a "
                        "`before` cell each")
    p.add_argument("--concurrency", type=int, default=0, help="0: the worker's default")
    p.add_argument("--batch", type=int, default=0, help="0: the worker's default")
    p.add_argument("--sleep", type=float, default=0.0,
                   help="seconds each handler awaits (io_bound.py: 0.005)")
    p.add_argument("--enqueue", default="",
                   help="MODE:COROUTINES (one:1, one:50, many:1): enqueue --jobs jobs with "
                        "benchmarks/enqueue.py instead of draining them")
    p.add_argument("--loop-clients", type=int, default=2,
                   help="pgbench clients of the `loop` cell (the article's loop)")
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cells", default="before,after,limited claim,exports",
                   help="which cells, by a word of their names, comma-separated (the first "
                        "named is the reference of the ratios)")
    args = p.parse_args()
    if not os.environ.get("ASYNCJOBQ_DSN"):
        sys.exit("set ASYNCJOBQ_DSN: each cell is a process of its own, and they must share "
                 "one server")
    bases = [b.strip() for b in args.base.split(",") if b.strip()]
    trees = [Path(tempfile.mkdtemp(prefix="ajq-ab-base-")) / "tree" for _ in bases]
    for commit, base in zip(bases, trees, strict=True):
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                        commit], check=True, capture_output=True)
        # One harness for all: this tree's benchmarks/, whose worker processes import the
        # asyncjobq of the tree they run in (common.Workers).
        shutil.rmtree(base / "benchmarks")
        shutil.copytree(ROOT / "benchmarks", base / "benchmarks",
                        ignore=shutil.ignore_patterns("results", "__pycache__"))
    befores: list[tuple[str, Path, list[str]]] = [
        (f"before ({commit})", base, []) for commit, base in zip(bases, trees, strict=True)]
    # The loop's batch: the worker's default one (10 at the default concurrency 20).
    loop_batch = args.batch or max(10, min(100, (args.concurrency or 20) // 2))
    loop = f"article loop (pgbench, batch {loop_batch}, {args.loop_clients} clients)"
    cells = [*befores, (loop, ROOT, []), ("after", ROOT, []),
             ("after, limited claim", ROOT, ["--limited-task"]),
             ("after, limited task on exports", ROOT, ["--limited-elsewhere"]),
             ("after, handler returns a result", ROOT, ["--return-result"])]
    wanted = [w.strip() for w in args.cells.split(",") if w.strip()]
    # `before` names every base's cell.
    cells = [c for w in wanted for c in (befores if w == "before" else
                                         [next(c for c in cells if w in c[0])])]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cells}
    try:
        for r in range(args.rounds):
            # Every other round in reverse order: no cell always follows the same one.
            for name, tree, extra in cells if r % 2 == 0 else cells[::-1]:
                log(f"limits A/B round {r + 1}/{args.rounds}: {name}")
                res = (run_loop(args.jobs, loop_batch, args.loop_clients) if name == loop
                       else run_cell(tree, args.jobs, extra, args.concurrency, args.batch,
                                args.sleep, args.enqueue))
                log(f"    {res['jobs_per_s']:,.0f} jobs/s")
                results[name].append(res)
    finally:
        for base in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base)], capture_output=True)
    print("| drain, 1 process | jobs/s (median) | rounds | worker CPU µs/job "
          "| server CPU µs/job (median) |")
    print("|---|---:|---|---:|---:|")
    for name, runs in results.items():
        rates = [x["jobs_per_s"] for x in runs]
        print(f"| {name} | {median(rates):,.0f} | {', '.join(f'{x:,.0f}' for x in rates)} | "
              f"{worker_us(runs)} | {server_us(runs)} |")
    ref = cells[0][0]
    before = median(x["jobs_per_s"] for x in results[ref])
    for name, _, _ in cells[1:]:
        now = median(x["jobs_per_s"] for x in results[name])
        print(f"\n{name}: {now / before:.3f}x the jobs/s of {ref}")
    if loop in results:
        at = server_per_job(results[loop])
        for name, _, _ in cells:
            if name != loop and at:
                print(f"\n{name}: server CPU per job {server_per_job(results[name]) / at:.2f}x"
                      " the article loop's")


def server_per_job(runs: list[dict[str, Any]]) -> float:
    """Median µs of server CPU per job; nan when /proc could not tell."""
    return median(1e6 * x["server_cpu_s"] / x["done"] for x in runs
                  if x.get("server_cpu_s") is not None and x["done"])


def worker_us(runs: list[dict[str, Any]]) -> str:
    per_job = median(1e6 * x["worker_cpu_s"] / x["done"] for x in runs if x["done"])
    return _us(per_job)


def server_us(runs: list[dict[str, Any]]) -> str:
    return _us(server_per_job(runs))


def _us(per_job: float) -> str:
    # An enqueue's few µs a row need their tenths.
    return "-" if per_job != per_job else f"{per_job:.{1 if per_job < 20 else 0}f}"


if __name__ == "__main__":
    main()
