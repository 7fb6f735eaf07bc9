"""1. The ceiling: pgbench running the article's two-statement loop on the article's DDL.

Each pgbench transaction is the article's worker loop for one batch, two statements, each its
own commit (autocommit, as the article's worker ran them):

    claim: UPDATE jobs SET status = 'running', ... WHERE id IN (SELECT id ... ORDER BY priority
           DESC, run_at, id LIMIT n FOR UPDATE SKIP LOCKED) RETURNING id
    done:  UPDATE jobs SET status = 'done', finished_at = now() WHERE id = ANY(<claimed ids>)

The claimed ids travel back to pgbench as one array (`\\gset`), which is cheaper for the client
than rows, so this is a ceiling for any client running the same loop. The table is refilled
for every cell; done rows stay in it, as in the article's design.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .common import Server, checkpoint, log

SCHEMA = "bench_ceiling"

# The article's table (its columns, names and partial index for the claim), default storage
# parameters: the article tunes autovacuum only later, in its bloat section.
DDL = """
DROP SCHEMA IF EXISTS {s} CASCADE;
CREATE SCHEMA {s};
CREATE TABLE {s}.jobs (
  id           bigserial PRIMARY KEY,
  queue        text        NOT NULL DEFAULT 'default',
  payload      jsonb       NOT NULL DEFAULT '{{}}',
  status       text        NOT NULL DEFAULT 'queued'
               CHECK (status IN ('queued', 'running', 'done', 'failed')),
  priority     int         NOT NULL DEFAULT 0,
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 3,
  locked_by    text,
  locked_at    timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  finished_at  timestamptz
);
CREATE INDEX jobs_dequeue_idx ON {s}.jobs (queue, priority DESC, run_at, id)
  WHERE status = 'queued';
"""

SCRIPT = (
    "WITH c AS (UPDATE {s}.jobs SET status = 'running', locked_by = 'pgbench',"
    " locked_at = now(), attempts = attempts + 1"
    " WHERE id IN (SELECT id FROM {s}.jobs WHERE queue = 'default' AND status = 'queued'"
    " AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT {n} FOR UPDATE SKIP LOCKED)"
    " RETURNING id)"
    " SELECT coalesce(array_agg(id), '{{}}')::text AS ids FROM c \\gset\n"
    "UPDATE {s}.jobs SET status = 'done', finished_at = now()"
    " WHERE id = ANY(':ids'::bigint[]);\n"
)

# Rows to prefill per second of run, generously above what 2 cores can claim.
PREFILL_RATE = {1: 6000, 10: 40000, 50: 90000}


def setup(server: Server) -> None:
    with server.connect() as conn:
        conn.execute(DDL.format(s=SCHEMA))


def refill(server: Server, rows: int) -> None:
    with server.connect() as conn:
        conn.execute(f"TRUNCATE {SCHEMA}.jobs")
        conn.execute(f"INSERT INTO {SCHEMA}.jobs (payload) SELECT '{{}}' FROM "
                     f"generate_series(1, {rows})")
        conn.execute(f"VACUUM ANALYZE {SCHEMA}.jobs")
    checkpoint(server)


def pgbench(server: Server, script: str, clients: int, duration: float) -> dict[str, Any]:
    """Run a custom pgbench script for `duration` s; returns tps and latency."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
        path = f.name
    try:
        cmd = [server.pgbench, "-n", "-M", "simple", "-c", str(clients), "-j", str(clients),
               "-T", str(int(duration)), "-f", path, server.dsn]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120)
    finally:
        Path(path).unlink(missing_ok=True)
    if p.returncode != 0:
        raise RuntimeError(f"pgbench failed: {p.stderr.strip()[-500:]}")
    tps = float(re.search(r"tps = ([\d.]+)", p.stdout).group(1))  # type: ignore[union-attr]
    lat = re.search(r"latency average = ([\d.]+) ms", p.stdout)
    done = re.search(r"actually processed: (\d+)", p.stdout)
    return {"tps": tps, "latency_ms": float(lat.group(1)) if lat else None,
            "transactions": int(done.group(1)) if done else None}


def cell(server: Server, batch: int, clients: int, duration: float) -> dict[str, Any]:
    refill(server, int(PREFILL_RATE[batch] * duration * 1.5) + 1000)
    res = pgbench(server, SCRIPT.format(s=SCHEMA, n=batch), clients, duration)
    with server.connect() as conn:
        done, queued = conn.execute(
            f"SELECT count(*) FILTER (WHERE status = 'done'),"
            f" count(*) FILTER (WHERE status = 'queued') FROM {SCHEMA}.jobs").fetchone()  # type: ignore[misc]
    if queued == 0:
        log(f"ceiling batch={batch} clients={clients}: table drained, figure is a lower bound")
    return {"jobs_per_s": done / duration, "done": done, "left": queued,
            "txn_per_s": res["tps"], "latency_ms": res["latency_ms"]}


def cells(server: Server, batches: list[int], clients: list[int],
          duration: float) -> list[tuple[str, Any]]:
    return [(f"ceiling b={b} c={c}", lambda b=b, c=c: cell(server, b, c, duration))
            for b in batches for c in clients]


def teardown(server: Server) -> None:
    with server.connect() as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
