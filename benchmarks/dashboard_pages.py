"""The dashboard's pages against a large history (issue 23): each page's time, slowest first.

    .venv/bin/python -m benchmarks.dashboard_pages --dsn postgresql://postgres@127.0.0.1:5432/postgres

Installs a scratch schema, fills jobs_history with --rows finished jobs (default 10,000,000)
in one INSERT ... SELECT generate_series (8 queues, 20 tasks, so that a task runs on 2 queues
only; 98 % done, 2 % cancelled, failed jobs staying in the live table; finished over the last
7 days, the newest 20,000 in the last hour), adds 10,000 queued and 500 failed live jobs,
VACUUM ANALYZE, then requests every page through the ASGI app once to warm up and --runs times
more, and prints the median and the slowest run of each. The schema is dropped at the end
unless --keep.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import httpx
import psycopg
from psycopg import sql

from asyncjobq import Queue
from asyncjobq.dashboard import create_app

FILL = """
INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority, run_at, attempts,
  max_attempts, dedup_key, locked_by, last_error, created_at, finished_at)
SELECT g, 'q' || (g %% 8), 't' || (g %% 20), '{{"n": 1}}'::jsonb,
  (CASE WHEN g %% 50 = 3 THEN 'cancelled' ELSE 'done' END)
    ::{s}.job_status,
  0, t, 1, 3, NULL, 'bench-worker-' || (g %% 4), NULL, t - interval '1 second', t
FROM generate_series(1, %(rows)s) AS g,
  LATERAL (SELECT CASE WHEN g > %(rows)s - 20000
                       THEN now() - (%(rows)s - g) * (interval '1 hour' / 20000)
                       ELSE now() - interval '7 days' + g * (interval '7 days' / %(rows)s)
                  END AS t) AS f
"""
LIVE = """
SELECT setval(pg_get_serial_sequence(%(jobs)s, 'id'), %(rows)s);
INSERT INTO {s}.jobs (queue, task, payload, status)
SELECT 'q' || (g %% 8), 't' || (g %% 20), '{{}}', 'queued' FROM generate_series(1, 10000) g;
INSERT INTO {s}.jobs (queue, task, payload, status, attempts, last_error, finished_at)
SELECT 'q' || (g %% 8), 't' || (g %% 20), '{{}}', 'failed', 3, 'attempt 3: boom', now()
FROM generate_series(1, 500) g;
"""


def pages(rows: int) -> list[str]:
    mid = rows // 2
    return [
        "/", "/jobs", f"/jobs?before={mid}", "/jobs?status=done", "/jobs?status=cancelled",
        "/jobs?status=failed", "/jobs?status=queued", "/jobs?queue=q3",
        f"/jobs?queue=q3&before={mid}", "/jobs?queue=q3&status=cancelled", "/jobs?task=t7",
        "/jobs?task=t7&status=cancelled", f"/jobs?task=t7&before={mid}",
        "/jobs?queue=q3&task=t7",  # task 7 runs on q3 and q7
        "/jobs?queue=q0&task=t7",  # never
        "/jobs?task=t4&status=cancelled",  # never: cancelled ids are odd, t4 ids even
        "/jobs?queue=nowhere", f"/jobs/{mid}", "/jobs/" + str(rows + 10), "/schedules",
        "/bulk?action=retry", "/bulk?action=cancel&queue=q3", "/bulk?action=retry&task=t7",
    ]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--schema", default=f"bench_dash_{uuid.uuid4().hex[:8]}")
    args = ap.parse_args()
    queue = Queue(args.dsn, schema=args.schema, pool_max_size=4)
    s = sql.Identifier(args.schema)
    try:
        async with queue:
            await queue.install()
            t0 = time.perf_counter()
            async with queue.connection() as conn:
                await conn.execute(sql.SQL(FILL).format(s=s), {"rows": args.rows})
                for statement in LIVE.strip().split(";\n"):
                    await conn.execute(sql.SQL(statement.rstrip(";")).format(s=s),
                                       {"rows": args.rows, "jobs": f'"{args.schema}".jobs'})
                # Rows inserted by hand are not counted (0010_history_counted.sql): doctor's
                # recount, as an operator would run it.
                await conn.execute(queue.sql.history_counts_recount)
            print(f"filled {args.rows:,} history rows in {time.perf_counter() - t0:.1f} s")
            with psycopg.connect(args.dsn, autocommit=True) as c:
                c.execute(sql.SQL("VACUUM ANALYZE {s}.jobs_history").format(s=s))
                c.execute(sql.SQL("VACUUM ANALYZE {s}.jobs").format(s=s))
            app = create_app(queue, read_only=False)
            transport = httpx.ASGITransport(app=app)
            results = []
            async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
                for path in pages(args.rows):
                    times = []
                    for i in range(args.runs + 1):
                        app.state.dash.forget()  # the overview's 2 s cache would hide its cost
                        start = time.perf_counter()
                        r = await client.get(path)
                        took = time.perf_counter() - start
                        assert r.status_code in (200, 404), (path, r.status_code, r.text[:300])
                        if i:
                            times.append(took)
                    results.append((statistics.median(times), max(times), path))
            print(f"{'median ms':>10} {'max ms':>8}  page  ({args.runs} runs each, "
                  f"{args.rows:,} history rows)")
            for med, worst, path in sorted(results, reverse=True):
                print(f"{med * 1000:10.1f} {worst * 1000:8.1f}  {path}")
    finally:
        if not args.keep:
            with psycopg.connect(args.dsn, autocommit=True) as c:
                c.execute(sql.SQL("DROP SCHEMA IF EXISTS {s} CASCADE").format(s=s))


if __name__ == "__main__":
    asyncio.run(main())
