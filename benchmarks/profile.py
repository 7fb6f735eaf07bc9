"""Where a draining worker's time goes: py-spy samples one default worker process.

    .venv/bin/python -m benchmarks.profile [--jobs 50000] [--batch 10] [--concurrency 20]

Samples the worker (py-spy record --idle, so time blocked in the event loop's poll, waiting for
PostgreSQL, is counted too) while it drains zero-work jobs, and CPU time of the server's
backends from /proc. Writes benchmarks/results/PROFILE.md and profile.txt (collapsed stacks).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .common import (
    RESULTS,
    Workers,
    checkpoint,
    drop_schema,
    last_finished,
    log,
    prepare_jobs,
    start_server,
    wait_drained,
)

SCHEMA = "bench_profile"

def other_thread(stack: list[str]) -> bool:
    """Samples of the heartbeat thread and anyio's worker threads, not the event loop."""
    return any("threading.py" in f or "WorkerThread" in f or "heartbeat.py" in f
               for f in stack)


def classify(stack: list[str]) -> str:
    """The event loop's sample by what it was doing: the innermost asyncjobq function on the
    stack (under uvloop a coroutine's stack starts at its task), and whether psycopg, anyio or
    its own code was running below it."""
    if not stack or stack[-1].startswith("Runner.run "):
        return "event loop: idle in poll, or inside uvloop's C code"
    part = next((f.split(" (")[0] for f in reversed(stack) if "asyncjobq/" in f
                 and "runtime.py" not in f), None)
    if part is None:
        part = next((f.split(" (")[0] for f in reversed(stack) if "benchmarks/" in f), "other")
    tail = stack[-4:]
    inner = ("psycopg" if any("psycopg" in f for f in stack) else
             "anyio" if any("anyio" in f for f in tail) else
             "asyncio" if any("asyncio" in f for f in tail) else "own code")
    return f"{part} → {inner}"


def module_of(frame: str) -> str:
    # py-spy raw frames look like "func (path/to/file.py:123)"
    if "(" not in frame:
        return frame
    fn, loc = frame.rsplit("(", 1)
    path = loc.split(":")[0]
    parts = Path(path).parts
    for anchor in ("asyncjobq", "psycopg", "psycopg_pool", "anyio", "asyncio", "uvloop"):
        if anchor in parts:
            i = parts.index(anchor)
            return f"{'/'.join(parts[i:])}:{fn.strip()}"
    return f"{Path(path).name}:{fn.strip()}"


def backend_cpu(server_pid_hint: str) -> float:
    """Sum of utime+stime (s) of every `postgres` process (the server and its backends)."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1: st.rindex(")")]
        if name.startswith("postgres") or name.startswith("postmaster"):
            fields = st[st.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=50_000)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=0)
    p.add_argument("--rate", type=int, default=250)
    p.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    server = start_server()
    try:
        prepare_jobs(server, SCHEMA, args.jobs)
        checkpoint(server)
        w = Workers(server, SCHEMA, 1, concurrency=args.concurrency, batch=args.batch,
                    record="none")
        w.wait_ready()
        raw = RESULTS / "profile.txt"
        spy = subprocess.Popen([pyspy, "record", "--pid", str(w.procs[0].pid), "--idle",
                                "--format", "raw", "--rate", str(args.rate), "-o", str(raw),
                                "--nonblocking"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        cpu0 = backend_cpu("")
        t0 = w.go()
        wait_drained(server, SCHEMA)
        done, t1 = last_finished(server, SCHEMA)
        cpu1 = backend_cpu("")
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
        res = w.stop()
        drop_schema(server, SCHEMA)
    finally:
        server.stop()
    elapsed = t1 - t0
    stacks: list[tuple[list[str], int]] = []
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        # drop the thread header py-spy puts first
        stacks.append((frames, int(n)))
    # Only the event loop's thread: skip the heartbeat's and anyio's worker threads.
    main_thread = [(f, n) for f, n in stacks if not other_thread(f)]
    total = sum(n for _, n in main_thread)
    buckets: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, n in main_thread:
        buckets[classify(frames)] += n
        if frames:
            leaves[module_of(frames[-1])] += n
        for m in {module_of(f) for f in frames if "asyncjobq/" in f or "psycopg" in f}:
            inclusive[m] += n
    lines = ["# Profile: one default worker draining zero-work jobs\n",
             f"`.venv/bin/python -m benchmarks.profile --jobs {args.jobs}"
             f"{' --batch ' + str(args.batch) if args.batch else ''}"
             f"{' --concurrency ' + str(args.concurrency) if args.concurrency else ''}`: "
             f"{done:,} jobs in {elapsed:.2f} s = **{done / elapsed:,.0f} jobs/s**. "
             f"py-spy {args.rate} Hz with `--idle` on the worker's event-loop thread "
             f"({total:,} samples).\n",
             f"- worker process CPU (user+sys): {res[0].cpu_s:.2f} s = "
             f"{res[0].cpu_s / done * 1e6:.0f} µs/job, {res[0].cpu_s / elapsed * 100:.0f} % "
             "of one core",
             f"- PostgreSQL processes' CPU over the run: {cpu1 - cpu0:.2f} s = "
             f"{(cpu1 - cpu0) / done * 1e6:.0f} µs/job, {(cpu1 - cpu0) / elapsed * 100:.0f} % "
             "of one core (the machine has 2)\n",
             "## Event-loop thread by part\n", "| part | share of samples |", "|---|---|"]
    lines += [f"| {k} | {v / total * 100:.1f} % |" for k, v in buckets.most_common(25)]
    lines += ["", "## Inclusive time, asyncjobq and psycopg functions (top 20)\n",
              "| function | share |", "|---|---|"]
    lines += [f"| `{k}` | {v / total * 100:.1f} % |" for k, v in inclusive.most_common(20)]
    lines += ["", "## Self time (leaf frames, top 20)\n", "| function | share |", "|---|---|"]
    lines += [f"| `{k}` | {v / total * 100:.1f} % |" for k, v in leaves.most_common(20)]
    (RESULTS / "PROFILE.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {RESULTS / 'PROFILE.md'}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
