"""Requeues (or fails, when attempts are spent) running jobs whose lease ran out.

Every worker runs a reaper, but a transaction-scoped advisory lock lets only one of them work
at a time; the others skip the turn. Every `prune_interval` the turn also prunes history past
retention (pruner.py), under its own lock so a long prune never delays reaping.
"""

from __future__ import annotations

import logging

import anyio
import psycopg
from psycopg_pool import PoolTimeout

from .errors import reason
from .pruner import Pruner
from .queue import Queue

log = logging.getLogger("asyncjobq.worker")

REAP_BATCH = 1000


class Reaper:
    def __init__(self, queue: Queue, *, lease: float, interval: float,
                 pruner: Pruner | None = None) -> None:
        self._queue = queue
        self._lease = lease
        self.interval = interval
        self.pruner = pruner
        self.reaped = 0

    async def run(self) -> None:
        next_prune = anyio.current_time()
        while True:
            await anyio.sleep(self.interval)
            try:
                await self.reap()
                if self.pruner is not None and anyio.current_time() >= next_prune:
                    next_prune = anyio.current_time() + self.pruner.interval
                    await self.pruner.turn()
            except (psycopg.OperationalError, PoolTimeout) as e:
                log.warning("maintenance turn failed (%s); trying again in %.0f s",
                            reason(e),
                            self.interval)

    async def reap(self) -> int:
        """One turn: returns how many stale jobs were requeued or failed."""
        st = self._queue.sql
        total = 0
        async with self._queue.connection() as conn:
            while True:
                async with conn.transaction():
                    cur = await conn.execute(st.reaper_try_lock)
                    row = await cur.fetchone()
                    if not row or not row[0]:
                        return total  # another worker's reaper is at it
                    cur = await conn.execute(
                        st.job_reap_stuck, {"lease": self._lease, "limit": REAP_BATCH}
                    )
                    rows = await cur.fetchall()
                    for queue in sorted({r[2] for r in rows if r[1] == "queued"}):
                        await conn.execute(
                            st.queue_notify, {"channel": self._queue.channel, "queue": queue}
                        )
                for job_id, status, _queue in rows:
                    log.warning("job %s: lease expired (worker stopped heartbeating); %s",
                                job_id, "requeued" if status == "queued" else "failed, no "
                                "attempts left")
                total += len(rows)
                self.reaped += len(rows)
                if len(rows) < REAP_BATCH:
                    return total
