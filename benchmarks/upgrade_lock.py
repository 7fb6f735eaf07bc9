"""What `install` locks, and for how long, on a schema of version --at (12 by default: the
install of 13, jobs partitioned by generation, and what follows) holding 1,000,000 queued jobs
(plus 1,000 with a dedup_key, 1 % failed):

    ASYNCJOBQ_DSN=postgresql://... .venv/bin/python -m benchmarks.upgrade_lock [--jobs 1000000]
        [--at 13]

The schema at --at is made by this tree's own migrations up to it. While `install` runs, a
reader runs the claim's scan of jobs every 10 ms: its longest wait is how long claims,
completions and enqueues stop. Prints one line per run; run it 3 times for medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time

import psycopg
from psycopg import sql

from asyncjobq import Queue
from asyncjobq._db import migrations

SCHEMA = "bench_upgrade13"


async def main(dsn: str, jobs: int, at: int) -> None:
    s = sql.Identifier(SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    every = migrations.available
    migrations.available = lambda: [m for m in every() if m.version <= at]  # type: ignore[assignment]
    q = Queue(dsn, schema=SCHEMA)
    async with q:
        await q.install()
    migrations.available = every  # type: ignore[assignment]
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("INSERT INTO {}.jobs (task, payload) SELECT 't',"
                          " jsonb_build_object('n', g) FROM generate_series(1, %s) g").format(s),
                  (jobs,))
        c.execute(sql.SQL("INSERT INTO {}.jobs (task, payload, dedup_key) SELECT 't', '{{}}',"
                          " 'k' || g FROM generate_series(1, 1000) g").format(s))
        c.execute(sql.SQL("UPDATE {}.jobs SET status = 'failed', finished_at = now()"
                          " WHERE id % 100 = 0").format(s))
        c.execute(sql.SQL("VACUUM ANALYZE {}.jobs").format(s))
        mb = c.execute("SELECT sum(pg_total_relation_size(relid)) / 1e6"
                       " FROM pg_partition_tree(%s::regclass)",
                       (f'"{SCHEMA}".jobs',)).fetchone()
    waits: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            scan = sql.SQL("SELECT id FROM {}.jobs WHERE status = 'queued' AND queue = 'default'"
                           " ORDER BY priority DESC, run_at, id LIMIT 1").format(s)
            while not stop.is_set():
                t0 = time.monotonic()
                c.execute(scan)
                waits.append(time.monotonic() - t0)
                time.sleep(0.01)

    q = Queue(dsn, schema=SCHEMA)
    async with q:
        thread = threading.Thread(target=reader)
        thread.start()
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        applied = await q.install()
        took = time.monotonic() - t0
        await asyncio.sleep(0.3)
        stop.set()
        thread.join()
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(sql.SQL("SELECT count(*) FROM {}.jobs_0").format(s)).fetchone()
        c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))
    print(f"{jobs + 1000:,} jobs ({float(mb[0] if mb else 0):.0f} MB), applied {applied}: "
          f"install {took:.2f} s, a reader of jobs waited {max(waits):.2f} s at most; "
          f"{rows[0] if rows else 0:,} rows in jobs_0 after")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1_000_000)
    p.add_argument("--at", type=int, default=12, help="the version the schema is at before")
    a = p.parse_args()
    asyncio.run(main(os.environ["ASYNCJOBQ_DSN"], a.jobs, a.at))
