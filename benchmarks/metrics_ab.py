"""The cost of Prometheus metrics (issue 20): the drain at default settings with
`--metrics-port` (metrics on: the hooks, the flush timing, the leader's depth sampler, the
HTTP server) against without, in the same run, alternating A B A B A B, medians of 3.

    .venv/bin/python -m benchmarks.metrics_ab [--jobs 50000] [--procs 1] [--rounds 3]

Uses $ASYNCJOBQ_DSN, else the embedded server (as `make bench`). Prints one Markdown table;
the issue asks for the overhead to stay under 5 % of jobs/s.
"""

from __future__ import annotations

import argparse

from .common import median, run_rounds, start_server
from .drain import drain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    server = start_server()
    try:
        cells = [
            ("metrics off", lambda: drain(server, "bench_metrics_ab", args.jobs, args.procs,
                                          record="none")),
            ("metrics on", lambda: drain(server, "bench_metrics_ab", args.jobs, args.procs,
                                         record="none", extra=("--metrics-port", "0"))),
        ]
        results = run_rounds(cells, args.rounds, "metrics A/B")
    finally:
        server.stop()
    off = median(r["jobs_per_s"] for r in results["metrics off"])
    print("| drain, default settings | jobs/s (median) | rounds | worker CPU s (median) |")
    print("|---|---:|---|---:|")
    for name, runs in results.items():
        rates = [r["jobs_per_s"] for r in runs]
        print(f"| {name} | {median(rates):,.0f} | {', '.join(f'{x:,.0f}' for x in rates)} | "
              f"{median(r['worker_cpu_s'] for r in runs):.1f} |")
    on = median(r["jobs_per_s"] for r in results["metrics on"])
    print(f"\noverhead: {100 * (off - on) / off:.1f} % of jobs/s")


if __name__ == "__main__":
    main()
