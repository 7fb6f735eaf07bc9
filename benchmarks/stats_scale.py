"""`stats()`, `health()` and the CLI's `status` against a large history (issue 17, item 8).

    .venv/bin/python -m benchmarks.stats_scale --dsn postgresql://postgres@127.0.0.1:5432/postgres
    .venv/bin/python -m benchmarks.stats_scale --dsn ... --keep      # leave the schema for --reuse
    .venv/bin/python -m benchmarks.stats_scale --dsn ... --reuse     # install (migrate), measure

Builds --rows finished jobs (default 10,000,000) in jobs_history of a scratch schema with
INSERT ... SELECT generate_series (4 queues; 85 % done, 10 % cancelled, 5 % failed; finished over
the last day, the newest 6,000 in the last minute) plus a few live rows in jobs, VACUUM ANALYZE,
then times each call once to warm up and 3 times more, and prints the medians and every run, and
the plan (EXPLAIN ANALYZE) of the statements behind them. `--reuse` instead runs `install` on the
kept schema first (timed: that is the migration on a large history) and measures that.
The schema is dropped at the end unless --keep.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from psycopg import sql

from asyncjobq import Queue

SCHEMA = "stats_scale"
# Retention at work: the oldest rows deleted, vacuumed, and as many newer ones written into the
# freed pages, finished 5 to 2 minutes ago (none in the last minute). A BRIN range keeps the
# oldest finished_at it ever held, so every range that took new rows now matches "finished in
# the last minute" too.
CHURN = "DELETE FROM {s}.jobs_history WHERE id <= %(churn)s"
CHURN_FILL = """
INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at, attempts,
  max_attempts, dedup_key, locked_by, last_error, created_at, finished_at)
SELECT g, (ARRAY['default', 'emails', 'reports', 'billing'])[1 + g %% 4], 'task', '{{}}'::jsonb,
  'done', 0, now(), 1, 3, NULL, 'bench-worker', NULL, now(),
  now() - interval '5 minutes' + (g - %(rows)s) * (interval '3 minutes' / %(churn)s)
FROM generate_series(%(rows)s + 1, %(rows)s + %(churn)s) AS g
"""
FILL = """
INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at, attempts,
  max_attempts, dedup_key, locked_by, last_error, created_at, finished_at)
SELECT g, (ARRAY['default', 'emails', 'reports', 'billing'])[1 + g %% 4], 'task_' || (g %% 7),
  '{{}}'::jsonb,
  (CASE WHEN g %% 20 = 0 THEN 'failed' WHEN g %% 10 = 1 THEN 'cancelled' ELSE 'done' END)
    ::{s}.job_status,
  0, t - interval '1 second', 1, 3, NULL, 'bench-worker', NULL, t - interval '1 second', t
FROM generate_series(1, %(rows)s) AS g,
  LATERAL (SELECT CASE WHEN g > %(rows)s - 6000
                       THEN now() - (%(rows)s - g) * interval '5 milliseconds'
                       ELSE now() - interval '1 day' + g * (interval '1 day' / %(rows)s)
                  END AS t) AS f
"""
LIVE = """
INSERT INTO {s}.jobs (queue, task, payload, status, attempts, finished_at)
SELECT (ARRAY['default', 'emails', 'reports', 'billing'])[1 + g % 4], 'task', '{{}}',
  (ARRAY['queued', 'queued', 'failed'])[1 + g % 3]::{s}.job_status, 1,
  CASE WHEN g % 3 = 2 THEN now() END
FROM generate_series(1, 3000) AS g
"""


def q(template: str, schema: str) -> sql.Composed:
    return sql.SQL(template).format(s=sql.Identifier(schema))


async def timed(what: str, call: Callable[[], Awaitable[Any]]) -> list[float]:
    await call()  # warm-up: caches, the pool's connections
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        await call()
        runs.append(time.perf_counter() - t0)
    report(what, runs)
    return runs


def report(what: str, runs: list[float]) -> None:
    print(f"{what:<34} median {statistics.median(runs) * 1000:9.1f} ms   runs "
          + ", ".join(f"{r * 1000:.1f}" for r in runs), flush=True)


def cli(dsn: str, schema: str, *args: str) -> list[float]:
    env = dict(os.environ, ASYNCJOBQ_DSN=dsn)
    command = [sys.executable, "-m", "asyncjobq", "status", "--schema", schema, *args]
    subprocess.run(command, env=env, check=True, capture_output=True)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run(command, env=env, check=True, capture_output=True)
        runs.append(time.perf_counter() - t0)
    report("cli status " + " ".join(args), runs)
    return runs


async def explain(conn: psycopg.AsyncConnection[Any], name: str, statement: sql.Composed,
                  params: Any = None) -> None:
    cur = await conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) ") + statement,
                             params)
    print(f"\n--- {name}")
    for (line,) in await cur.fetchall():
        print("   ", line)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("ASYNCJOBQ_DSN"), required=False)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--schema", default=SCHEMA)
    parser.add_argument("--churn", type=int, default=0, metavar="ROWS",
                        help="then delete the oldest ROWS and write as many into their pages")
    parser.add_argument("--keep", action="store_true", help="do not drop the schema at the end")
    parser.add_argument("--reuse", action="store_true",
                        help="measure the kept schema (after running install on it)")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn or $ASYNCJOBQ_DSN")
    schema = args.schema
    queue = Queue(args.dsn, schema=schema, pool_max_size=4)
    async with queue:
        async with queue.connection() as conn:
            if args.reuse:
                t0 = time.perf_counter()
                applied = await queue.install()
                print(f"install on the kept schema applied {applied} in "
                      f"{time.perf_counter() - t0:.2f} s")
            else:
                await conn.execute(q("DROP SCHEMA IF EXISTS {s} CASCADE", schema))
                await queue.install()
                t0 = time.perf_counter()
                await conn.execute(q(FILL, schema), {"rows": args.rows})
                await conn.execute(q(LIVE, schema))
                print(f"filled {args.rows:,} history rows in {time.perf_counter() - t0:.0f} s")
                await conn.execute(q("VACUUM ANALYZE {s}.jobs_history", schema))
                await conn.execute(q("VACUUM ANALYZE {s}.jobs", schema))
                if args.churn:
                    params = {"rows": args.rows, "churn": args.churn}
                    await conn.execute(q(CHURN, schema), params)
                    await conn.execute(q("VACUUM {s}.jobs_history", schema))
                    await conn.execute(q(CHURN_FILL, schema), params)
                    await conn.execute(q("VACUUM ANALYZE {s}.jobs_history", schema))
                    print(f"churned {args.churn:,} rows")
                # Rows inserted by hand are not counted (0010_history_counted.sql): doctor's
                # recount, as an operator would run it.
                await conn.execute(queue.sql.history_counts_recount)
            cur = await conn.execute(
                "SELECT pg_size_pretty(pg_total_relation_size(%s::regclass))",
                (f"{schema}.jobs_history",))
            print(f"jobs_history with its indexes: {(await cur.fetchone() or ['?'])[0]}")

            await timed("stats()", queue.stats)
            await timed("health()", queue.health)
            await timed("leader()", queue.leader)
            stats = await queue.stats()
            print("stats():", {k: v for k, v in sorted(stats.items())})
            cli(args.dsn, schema)
            cli(args.dsn, schema, "--json")

            st = queue.sql
            await explain(conn, "stats: job_count_by_queue_status", st.job_count_by_queue_status)
            await explain(conn, "health: queue_health", st.queue_health, (30.0,))
        if not args.keep:
            async with queue.connection() as conn:
                await conn.execute(q("DROP SCHEMA {s} CASCADE", schema))
            print(f"\ndropped schema {schema}")


if __name__ == "__main__":
    asyncio.run(main())
