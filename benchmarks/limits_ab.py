"""The cost of flow control for tasks without limits (issue 21): the drain at default
settings, in the same run, alternating, medians of 3:

- before: the commit before flow control (a git worktree of --base): its worker, its schema;
- after: this tree, a worker whose tasks have no limits (it runs the claim statements it ran
  before; the schema has version 7's columns);
- after, limited claim: this tree, a worker that also registers a limited task, so that every
  claim goes through the limited statement (sql/claim.py) although no job has a limit;
- after, limited task on exports: this tree, a worker of `default` in an app whose limited
  task runs on another queue, `exports`: it must claim as a worker without limits does;
- after, handler returns a result: this tree, the handler returns a small dict, stored as the
  job's result (docs/guides/results.md): the cost of results against a handler returning None.

Both trees run this tree's benchmarks/ (copied over the base worktree's), so that only src/
differs. Server CPU per job is the PostgreSQL processes' CPU from release to drained
(common.server_cpu_s): nothing else may use the server meanwhile.

    ASYNCJOBQ_DSN=postgresql://... .venv/bin/python -m benchmarks.limits_ab [--base d003a27]
        [--jobs 50000] [--rounds 3]

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
from pathlib import Path
from typing import Any

from .common import ROOT, log, median

CELL = (
    "import json, sys\n"
    "from benchmarks.common import start_server\n"
    "from benchmarks.drain import drain\n"
    "server = start_server()\n"
    "try:\n"
    "    r = drain(server, 'bench_limits_ab', int(sys.argv[1]), 1, record='none',\n"
    "              extra=tuple(sys.argv[2:]))\n"
    "finally:\n"
    "    server.stop()\n"
    "print('RESULT ' + json.dumps(r))\n"
)


def run_cell(tree: Path, jobs: int, extra: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    out = subprocess.run([sys.executable, "-c", CELL, str(jobs), *extra], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    raise RuntimeError(f"cell in {tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="d003a27", help="the commit before flow control")
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cells", default="before,after,limited claim,exports",
                   help="which cells, by a word of their names, comma-separated (the first "
                        "named is the reference of the ratios)")
    args = p.parse_args()
    if not os.environ.get("ASYNCJOBQ_DSN"):
        sys.exit("set ASYNCJOBQ_DSN: each cell is a process of its own, and they must share "
                 "one server")
    base = Path(tempfile.mkdtemp(prefix="ajq-ab-base-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                    args.base], check=True, capture_output=True)
    # One harness for both: this tree's benchmarks/, whose worker processes import the
    # asyncjobq of the tree they run in (common.Workers).
    shutil.rmtree(base / "benchmarks")
    shutil.copytree(ROOT / "benchmarks", base / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    cells = [(f"before ({args.base})", base, []), ("after", ROOT, []),
             ("after, limited claim", ROOT, ["--limited-task"]),
             ("after, limited task on exports", ROOT, ["--limited-elsewhere"]),
             ("after, handler returns a result", ROOT, ["--return-result"])]
    wanted = [w.strip() for w in args.cells.split(",") if w.strip()]
    cells = [next(c for c in cells if w in c[0]) for w in wanted]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in cells}
    try:
        for r in range(args.rounds):
            # Every other round in reverse order: no cell always follows the same one.
            for name, tree, extra in cells if r % 2 == 0 else cells[::-1]:
                log(f"limits A/B round {r + 1}/{args.rounds}: {name}")
                res = run_cell(tree, args.jobs, extra)
                log(f"    {res['jobs_per_s']:,.0f} jobs/s")
                results[name].append(res)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       capture_output=True)
    print("| drain, default settings, 1 process | jobs/s (median) | rounds | worker CPU s "
          "| server CPU µs/job (median) |")
    print("|---|---:|---|---:|---:|")
    for name, runs in results.items():
        rates = [x["jobs_per_s"] for x in runs]
        print(f"| {name} | {median(rates):,.0f} | {', '.join(f'{x:,.0f}' for x in rates)} | "
              f"{median(x['worker_cpu_s'] for x in runs):.1f} | {server_us(runs)} |")
    ref = cells[0][0]
    before = median(x["jobs_per_s"] for x in results[ref])
    for name, _, _ in cells[1:]:
        now = median(x["jobs_per_s"] for x in results[name])
        print(f"\n{name}: {now / before:.3f}x the jobs/s of {ref}")


def server_us(runs: list[dict[str, Any]]) -> str:
    per_job = [1e6 * x["server_cpu_s"] / x["done"] for x in runs
               if x.get("server_cpu_s") is not None and x["done"]]
    return f"{median(per_job):.0f}" if per_job else "-"


if __name__ == "__main__":
    main()
