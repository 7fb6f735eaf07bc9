"""4. The article's lock experiment: no lock vs FOR UPDATE vs SKIP LOCKED.

Each worker is its own connection running the article's naive loop, one job at a time:

    BEGIN; SELECT id FROM jobs WHERE status = 'queued' ORDER BY priority DESC, run_at, id
           LIMIT 1 [FOR UPDATE [SKIP LOCKED]];
    UPDATE jobs SET status = 'running', ... WHERE id = $1; COMMIT;
    INSERT INTO executions (job_id) VALUES ($1);          -- the "work"
    UPDATE jobs SET status = 'done', finished_at = now() WHERE id = $1;

Workers are separate processes (like the article's), released together. Without a lock two
workers read the same queued row before either marks it running: a double claim, counted as
jobs with more than one row in executions.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import psycopg

from .ceiling import DDL
from .common import Server, checkpoint, release, spawn

SCHEMA = "bench_locks"  # the article's table, as in ceiling.py

LOCKS = {"none": "", "for_update": " FOR UPDATE", "skip_locked": " FOR UPDATE SKIP LOCKED"}


def worker(dsn: str, lock: str) -> None:
    select = (f"SELECT id FROM {SCHEMA}.jobs WHERE queue = 'default' AND status = 'queued'"
              f" AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 1{LOCKS[lock]}")
    with psycopg.connect(dsn) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        while True:
            with conn.transaction():
                row = conn.execute(select).fetchone()
                if row is None:
                    break
                conn.execute(f"UPDATE {SCHEMA}.jobs SET status = 'running', locked_by = %s,"
                             " locked_at = now(), attempts = attempts + 1 WHERE id = %s",
                             (str(os.getpid()), row[0]))
            with conn.transaction():
                conn.execute(f"INSERT INTO {SCHEMA}.executions (job_id) VALUES (%s)", row)
            with conn.transaction():
                conn.execute(f"UPDATE {SCHEMA}.jobs SET status = 'done', finished_at = now()"
                             " WHERE id = %s", row)


def cell(server: Server, lock: str, workers: int, jobs: int) -> dict[str, Any]:
    with server.connect() as conn:
        conn.execute(DDL.format(s=SCHEMA))
        conn.execute(f"CREATE TABLE {SCHEMA}.executions (job_id bigint NOT NULL,"
                     " at timestamptz NOT NULL DEFAULT clock_timestamp())")
        conn.execute(f"INSERT INTO {SCHEMA}.jobs (payload) SELECT '{{}}'"
                     f" FROM generate_series(1, {jobs})")
        conn.execute(f"VACUUM ANALYZE {SCHEMA}.jobs")
    checkpoint(server)
    procs = [spawn("locks", server.dsn, lock) for _ in range(workers)]
    t0 = release(procs)
    for p in procs:
        p.wait(600)
    elapsed = time.monotonic() - t0
    with server.connect() as conn:
        execs, distinct, twice = conn.execute(
            f"SELECT count(*), count(DISTINCT job_id), (SELECT count(*) FROM (SELECT job_id"
            f" FROM {SCHEMA}.executions GROUP BY job_id HAVING count(*) > 1) d)"
            f" FROM {SCHEMA}.executions").fetchone()  # type: ignore[misc]
        conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")
    return {"jobs_per_s": distinct / elapsed, "executions": execs, "jobs_run": distinct,
            "double_claimed": twice, "elapsed_s": elapsed}


def cells(server: Server, workers: list[int], jobs: int) -> list[tuple[str, Any]]:
    return [(f"locks {lock} w={w}", lambda lock=lock, w=w: cell(server, lock, w, jobs))
            for lock in LOCKS for w in workers]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
