"""Requeues (or fails, when attempts are spent) running jobs whose lease ran out.

A leader-only service (leader.py, services.py); a transaction-scoped advisory lock still
keeps a second reaper out for the instant two workers might both believe they lead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .._db.database import Database
from ..hooks import Hooks
from ..job import log_fields
from .services import Service

log = logging.getLogger("asyncjobq.reaper")

REAP_BATCH = 1000


_REAPED_AS = {"queued": "requeued", "failed": "failed, no attempts left",
              "cancelled": "cancelled, as asked while it ran"}


class Reaper(Service):
    """A leader-only maintenance service (services.py)."""

    name = "reaper"
    leader_only = True

    def __init__(self, db: Database, *, lease: float, interval: float,
                 hooks: Hooks | None = None,
                 observe: Callable[[list[tuple[str, str, str]]], None] | None = None) -> None:
        self._db = db
        self._lease = lease
        self.interval = interval
        self._hooks = hooks
        # Its own connection: handlers holding every pooled one must not stall reaping.
        self._conn = self.use_own_connection(db, "reaper")
        # Told (queue, task, new status) of each job taken back (the metrics' reaped count).
        self._observe = observe
        self.reaped = 0

    async def turn(self) -> list[int]:
        return await self.reap_ids()

    async def reap(self) -> int:
        """Requeue (or fail) stale jobs now; returns how many."""
        return len(await self.reap_ids())

    async def reap_ids(self) -> list[int]:
        """Requeue (or fail) stale jobs now; returns their ids. on_reaped hears of each batch
        once it is committed, so a later batch that fails loses none of the earlier ones."""
        st = self._db.sql
        total: list[int] = []
        async with self._conn.connection() as conn:
            while True:
                async with conn.transaction():
                    cur = await conn.execute(st.reaper_try_lock)
                    row = await cur.fetchone()
                    if not row or not row[0]:
                        return total  # another reaper is at it (two leaders for an instant)
                    cur = await conn.execute(
                        st.job_reap_stuck, {"lease": self._lease, "limit": REAP_BATCH,
                                            "channel": self._db.channel,
                                            "done": self._db.done_channel})
                    rows = [r for r in await cur.fetchall() if r[0] is not None]
                for job_id, status, queue, task, worker in rows:
                    log.warning("job %s (%s): lease expired (worker %s stopped heartbeating); "
                                "%s", job_id, task, worker, _REAPED_AS.get(status, status),
                                extra=log_fields(job_id, task, queue))
                ids = [int(r[0]) for r in rows]
                total.extend(ids)
                self.reaped += len(rows)
                if ids and self._hooks is not None and self._hooks.on_reaped:
                    self._hooks.spawn("on_reaped", job_ids=ids)
                if rows and self._observe is not None:
                    self._observe([(r[2], r[3], r[1]) for r in rows])
                if len(rows) < REAP_BATCH:
                    return total
