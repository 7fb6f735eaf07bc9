"""What one `asyncjobq.testing.isolated()` block costs (README: Testing your jobs): create,
install and open a schema, then close and drop it; and the install and the drop alone.

    .venv/bin/python -m benchmarks.isolated_cost [DSN]     # no DSN: a throwaway embedded server

Not part of `make bench`: it answers whether a per-test schema needs a template (it does not:
the install is tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from psycopg import sql

from asyncjobq import Queue
from asyncjobq.testing import isolated

ROUNDS = 20


def _ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1000:.1f} ms, max {max(samples) * 1000:.1f} ms"


async def measure(dsn: str) -> None:
    app = Queue(schema="unused")
    whole: list[float] = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        async with isolated(app, dsn=dsn):
            pass
        whole.append(time.perf_counter() - t)
    install: list[float] = []
    drop: list[float] = []
    for _ in range(ROUNDS):
        schema = f"cost_{uuid.uuid4().hex[:12]}"
        async with Queue(dsn, schema=schema) as q:
            t = time.perf_counter()
            await q.install()
            install.append(time.perf_counter() - t)
            async with q.connection() as conn:
                t = time.perf_counter()
                await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(
                    sql.Identifier(schema)))
                drop.append(time.perf_counter() - t)
    print(f"isolated() block: {_ms(whole)}")
    print(f"install alone:    {_ms(install)}")
    print(f"drop alone:       {_ms(drop)}")


def main() -> None:
    if len(sys.argv) > 1:
        asyncio.run(measure(sys.argv[1]))
        return
    from asyncjobq._db.embedded import start_pgserver

    server = start_pgserver(Path(tempfile.mkdtemp()) / "pg", cleanup_mode="delete")
    try:
        asyncio.run(measure(server.get_uri()))
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
