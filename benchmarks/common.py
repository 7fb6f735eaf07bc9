"""What every measurement shares: the server, fresh schemas, worker processes, pgbench, medians.

The server is $ASYNCJOBQ_DSN when set, else an embedded PostgreSQL (pgserver) in
benchmarks/.pgdata that this process starts and stops. Every cell gets a fresh schema, dropped
afterwards, so no cell sees another's dead rows.
"""

from __future__ import annotations

import asyncio
import glob
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PGDATA = HERE / ".pgdata"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of xs."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


@dataclass
class Server:
    dsn: str
    pgbench: str
    embedded: bool
    handle: Any = None
    info: dict[str, str] = field(default_factory=dict)

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def stop(self) -> None:
        if self.handle is not None:
            try:
                self.handle.cleanup()
            except Exception as e:  # pragma: no cover - best effort at exit
                log(f"stopping the embedded server: {e}")


def find_pgbench(embedded: bool) -> str:
    candidates: list[str] = []
    if embedded:
        import pgserver  # type: ignore[import-untyped]

        candidates.append(str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench"))
    on_path = shutil.which("pgbench")
    if on_path:
        candidates.append(on_path)
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin/pgbench"), reverse=True)
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    raise SystemExit("pgbench not found: install PostgreSQL's client tools "
                     "(Debian: apt-get install postgresql-client) or pip install pgserver")


def start_server() -> Server:
    dsn = os.environ.get("ASYNCJOBQ_DSN")
    if dsn:
        server = Server(dsn=dsn, pgbench=find_pgbench(False), embedded=False)
    else:
        from asyncjobq._db.embedded import start_pgserver

        log(f"starting embedded PostgreSQL in {PGDATA}")
        handle = start_pgserver(PGDATA, cleanup_mode="stop")
        server = Server(dsn=str(handle.get_uri()), pgbench=find_pgbench(True), embedded=True,
                        handle=handle)
    with server.connect() as conn:
        rows = conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
            (["server_version", "fsync", "synchronous_commit", "wal_sync_method",
              "shared_buffers", "max_connections", "full_page_writes", "wal_level",
              "autovacuum", "jit", "block_size"],),
        ).fetchall()
    server.info = {k: v for k, v in rows}
    pgbench_version = subprocess.run([server.pgbench, "--version"], capture_output=True,
                                     text=True).stdout.strip()
    server.info["pgbench"] = f"{server.pgbench} ({pgbench_version})"
    return server


def pgbench_conninfo(dsn: str) -> list[str]:
    """pgbench takes the DSN as its dbname argument (libpq expands a URI there)."""
    return [dsn]


def fresh_schema(server: Server, name: str) -> str:
    with server.connect() as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
    return name


def drop_schema(server: Server, name: str) -> None:
    with server.connect() as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def checkpoint(server: Server) -> None:
    """Start each cell from the same WAL state: a checkpoint and a short pause."""
    with server.connect() as conn:
        conn.execute("CHECKPOINT")


async def install_schema(dsn: str, schema: str) -> None:
    from asyncjobq import Queue

    q = Queue(dsn, schema=schema)
    async with q:
        await q.install()


async def enqueue_bulk(dsn: str, schema: str, n: int, payload: dict[str, Any] | None = None,
                       chunk: int = 5000, task: str = "noop") -> None:
    from asyncjobq import Queue

    q = Queue(dsn, schema=schema)
    async with q:
        left = n
        while left > 0:
            k = min(chunk, left)
            await q.enqueue_many(task, [payload or {}] * k)
            left -= k
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}.jobs").format(sql.Identifier(schema)))


def prepare_jobs(server: Server, schema: str, n: int) -> None:
    fresh_schema(server, schema)
    asyncio.run(install_schema(server.dsn, schema))
    if n:
        asyncio.run(enqueue_bulk(server.dsn, schema, n))


# --- worker processes --------------------------------------------------------------------

def spawn(module: str, *args: str) -> subprocess.Popen[str]:
    """A `python -m benchmarks.<module>` process that prints `ready` and waits for `go`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)


def release(procs: Sequence[subprocess.Popen[str]]) -> float:
    """Wait until every process said `ready`, then release them together; returns t0."""
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            for q in procs:
                q.kill()
            raise RuntimeError(f"benchmark process did not start (said {line!r})")
    t0 = time.monotonic()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return t0


@dataclass
class WorkerResult:
    ids: list[int]
    latencies: list[float]
    maxrss_kb: int
    cpu_s: float
    completed: int
    rss_samples_kb: list[int]


class Workers:
    """N `benchmarks.worker_proc` processes: started, ready, released together, stopped."""

    def __init__(self, server: Server, schema: str, n: int, *, concurrency: int, batch: int,
                 sleep: float = 0.0, listen: bool = True, poll_interval: float = 1.0,
                 record: str = "ids", extra: Sequence[str] = ()) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="ajq-bench-"))
        self.procs: list[subprocess.Popen[str]] = []
        self.outs: list[Path] = []
        # src first: this tree's asyncjobq, also when another tree's is installed (the A/B of
        # benchmarks/limits_ab.py runs an older commit's tree).
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        for i in range(n):
            out = self.tmp / f"w{i}.json"
            cmd = [sys.executable, "-m", "benchmarks.worker_proc", "--dsn", server.dsn,
                   "--schema", schema, "--concurrency", str(concurrency), "--batch", str(batch),
                   "--sleep", str(sleep), "--poll-interval", str(poll_interval),
                   "--record", record, "--out", str(out), *extra]
            if not listen:
                cmd.append("--no-listen")
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, text=True, env=env,
                                               cwd=ROOT))
            self.outs.append(out)

    def wait_ready(self, timeout: float = 60.0) -> None:
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                self.kill()
                raise RuntimeError(f"benchmark worker did not start (said {line!r})")

    def go(self) -> float:
        t0 = time.time()
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return t0

    def stop(self, timeout: float = 60.0) -> list[WorkerResult]:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        results = []
        for p, out in zip(self.procs, self.outs, strict=True):
            p.wait(timeout)
            data = json.loads(out.read_text())
            results.append(WorkerResult(**data))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def server_cpu_s() -> float | None:
    """CPU seconds used so far by this machine's PostgreSQL processes (every `postgres`
    process's own, plus what the postmaster reaped of backends that exited), or None where
    /proc cannot tell. A difference over a run is the server's CPU for that run, as long as
    nothing else uses the server meanwhile."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name != "postgres":
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), counted from the state.
        total += sum(int(x) for x in fields[11:15])
    return total / tick


def wait_drained(server: Server, schema: str, timeout: float = 600.0,
                 interval: float = 0.05) -> None:
    """Until the hot table holds no queued or running job (finished rows leave it)."""
    q = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {s}.jobs WHERE status = 'queued')"
        " OR EXISTS (SELECT 1 FROM {s}.jobs WHERE status = 'running')"
    ).format(s=sql.Identifier(schema))
    deadline = time.monotonic() + timeout
    with server.connect() as conn:
        while True:
            busy = conn.execute(q).fetchone()
            if busy is not None and not busy[0]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{schema}: jobs not drained within {timeout} s")
            time.sleep(interval)


def last_finished(server: Server, schema: str) -> tuple[int, float]:
    """(done rows in history, epoch of the last one's completion)."""
    with server.connect() as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*), extract(epoch FROM max(finished_at))::float8"
            " FROM {}.jobs_history WHERE status = 'done'").format(sql.Identifier(schema))
        ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1] or 0.0)


def double_claims(results: Sequence[WorkerResult]) -> tuple[int, int]:
    """(executions beyond the first per job, jobs executed more than once)."""
    seen: dict[int, int] = {}
    for r in results:
        for i in r.ids:
            seen[i] = seen.get(i, 0) + 1
    extra = sum(c - 1 for c in seen.values())
    jobs = sum(1 for c in seen.values() if c > 1)
    return extra, jobs


# --- interleaving --------------------------------------------------------------------------

Cell = tuple[str, Callable[[], dict[str, Any]]]


def run_rounds(cells: Sequence[Cell], rounds: int, label: str) -> dict[str, list[dict[str, Any]]]:
    """Run every cell once per round, in the same order each round (A B A B ...)."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cells}
    for r in range(rounds):
        for name, fn in cells:
            log(f"{label} round {r + 1}/{rounds}: {name}")
            res = fn()
            log(f"    {json.dumps(res, default=str)[:200]}")
            out[name].append(res)
    return out


def spawn_app_worker(app: str, dsn: str, *extra: str) -> subprocess.Popen[bytes]:
    """A worker process of `app` (module:queue, under benchmarks/), as users start one."""
    env = {**os.environ, "ASYNCJOBQ_DSN": dsn, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "asyncjobq", "worker", app,
                             "--log-level", "warning", *extra], cwd=ROOT, env=env)


def save_parts(name: str, parts: str, result: dict[str, Any], label: str = "") -> None:
    """Write a study's JSON as results/<name>-<parts>[-<label>].json, and print it."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}-{parts.replace(',', '-')}{'-' + label if label else ''}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
