"""5. Enqueue: asyncjobq's enqueue()/enqueue_many() against pgbench INSERTs into the same table.

Both write asyncjobq's own jobs table in a fresh schema, so both fire its statement-level
NOTIFY trigger (notifications on) and maintain the same indexes. pgbench's single-row INSERT is
the ceiling for enqueue(), its 100-row INSERT ... SELECT the ceiling for enqueue_many().
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncjobq import Queue

from .ceiling import pgbench
from .common import Server, checkpoint, drop_schema, fresh_schema, install_schema, server_cpu_s

SCHEMA = "bench_enqueue"

INSERT_ONE = "INSERT INTO {s}.jobs (task, payload) VALUES ('noop', '{{}}');\n"
INSERT_100 = ("INSERT INTO {s}.jobs (task, payload) SELECT 'noop', '{{}}'"
              " FROM generate_series(1, 100);\n")


def _fresh(server: Server) -> None:
    fresh_schema(server, SCHEMA)
    asyncio.run(install_schema(server.dsn, SCHEMA))
    checkpoint(server)


def pgbench_cell(server: Server, rows: int, clients: int, duration: float) -> dict[str, Any]:
    _fresh(server)
    script = (INSERT_ONE if rows == 1 else INSERT_100).format(s=SCHEMA)
    res = pgbench(server, script, clients, duration)
    drop_schema(server, SCHEMA)
    return {"rows_per_s": res["tps"] * rows, "txn_per_s": res["tps"],
            "latency_ms": res["latency_ms"]}


async def _enqueue(dsn: str, mode: str, n: int, coroutines: int) -> dict[str, Any]:
    q = Queue(dsn, schema=SCHEMA)
    async with q:
        # Warm the pool up to what the run will use, outside the timing.
        async def warm() -> None:
            async with q.connection() as c:
                await c.execute("SELECT 1")
                await asyncio.sleep(0.05)
        await asyncio.gather(*(warm() for _ in range(min(coroutines, 10))))
        # The CPU of the timed part alone: the server's (every PostgreSQL process, nothing
        # else may use it meanwhile) and this producer process's.
        cpu0, own0 = server_cpu_s(), time.process_time()
        t0 = time.perf_counter()
        if mode == "one":
            per = n // coroutines

            async def producer() -> None:
                for _ in range(per):
                    await q.enqueue("noop", {})
            await asyncio.gather(*(producer() for _ in range(coroutines)))
            done = per * coroutines
        elif mode == "many":
            await q.enqueue_many("noop", [{}] * n)
            done = n
        else:  # "many100": n jobs as n/100 calls of 100
            for _ in range(n // 100):
                await q.enqueue_many("noop", [{}] * 100)
            done = n // 100 * 100
        elapsed = time.perf_counter() - t0
        cpu1, own1 = server_cpu_s(), time.process_time()
        return {"rows_per_s": done / elapsed, "rows": done,
                "server_cpu_s": cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
                "producer_cpu_s": own1 - own0}


def asyncjobq_cell(server: Server, mode: str, n: int, coroutines: int = 1) -> dict[str, Any]:
    _fresh(server)
    from asyncjobq.runtime import run

    result = run(_enqueue, server.dsn, mode, n, coroutines)
    drop_schema(server, SCHEMA)
    return result


def cells(server: Server, n_one: int, n_many: int, duration: float) -> list[tuple[str, Any]]:
    return [
        ("pgbench insert 1 row c=1", lambda: pgbench_cell(server, 1, 1, duration)),
        ("pgbench insert 1 row c=4", lambda: pgbench_cell(server, 1, 4, duration)),
        ("pgbench insert 100 rows c=1", lambda: pgbench_cell(server, 100, 1, duration)),
        ("enqueue() x1", lambda: asyncjobq_cell(server, "one", n_one, 1)),
        ("enqueue() x50", lambda: asyncjobq_cell(server, "one", n_one * 2, 50)),
        ("enqueue_many(10000)", lambda: asyncjobq_cell(server, "many", n_many)),
        ("enqueue_many(100) x100", lambda: asyncjobq_cell(server, "many100", n_many)),
    ]
