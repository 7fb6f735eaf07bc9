"""Retention: deletes finished jobs from jobs_history once older than their queue's retention,
and folds the shards of history's counts (0003_history_counts.sql).

Pruning runs in bounded batches, each its own short transaction, so it never holds locks for
long nor a snapshot that would stop vacuum. Failed (dead-lettered) jobs are never pruned by
age; `prune_failed` deletes them only when asked to.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel

from .._db.database import Database
from ..retention import Retention
from .services import Service

log = logging.getLogger("asyncjobq.pruner")

DEFAULT_RETENTION = timedelta(days=1)
PRUNE_BATCH = 5000
# Per maintenance turn; a backlog bigger than this is worked off over the next turns.
MAX_BATCHES_PER_TURN = 20

def _add(total: dict[str, int], rows: list[tuple[Any, ...]]) -> int:
    n = 0
    for queue, count in rows:
        total[queue] = total.get(queue, 0) + int(count)
        n += int(count)
    return n


async def prune_history(db: Database, retention: Retention, *, batch: int = PRUNE_BATCH,
                        max_batches: int | None = None, wait: bool = False) -> dict[str, int]:
    """Delete expired history in batches; returns {queue: rows deleted}.

    One pruner at a time per schema (advisory lock): with `wait=False` (the workers' turn) a
    batch is skipped when another process holds it; `wait=True` (a manual prune) queues up.
    """
    total: dict[str, int] = {}
    if retention.min_age is None:
        return total
    st = db.sql
    params = retention.params(batch)
    done = 0
    async with db.connection() as conn:
        while max_batches is None or done < max_batches:
            with db.translate_errors():
                async with conn.transaction():
                    cur = await conn.execute(st.pruner_lock if wait else st.pruner_try_lock)
                    locked = await cur.fetchone()
                    if not wait and not (locked and locked[0]):
                        return total
                    cur = await conn.execute(st.job_history_delete_expired, params)
                    n = _add(total, await cur.fetchall())
            done += 1
            if n < batch:
                break
            await anyio.lowlevel.checkpoint()  # let the worker's other tasks run between batches
    return total


async def fold_history_counts(db: Database) -> None:
    """Sum the writers' shards of history_counts into one row per (queue, status) and drop
    queues whose history is gone: stats() then reads one row per queue and status instead of
    up to 65. Exact at any time; safe beside writers and another fold."""
    async with db.connection() as conn:
        with db.translate_errors():
            await conn.execute(db.sql.history_counts_fold)
            await conn.execute(db.sql.history_counts_delete_empty)


async def prune_failed(db: Database, older_than: float, *, only_queue: str | None = None,
                       batch: int = PRUNE_BATCH) -> dict[str, int]:
    """Delete failed jobs that finished more than `older_than` seconds ago."""
    total: dict[str, int] = {}
    params = {"age": older_than, "queue": only_queue, "limit": batch}
    async with db.connection() as conn:
        while True:
            with db.translate_errors():
                cur = await conn.execute(db.sql.job_failed_delete_older, params)
                n = _add(total, await cur.fetchall())
            if n < batch:
                return total


class Pruner(Service):
    """Retention, a leader-only maintenance service: at most `MAX_BATCHES_PER_TURN` batches a
    turn."""

    name = "pruner"
    leader_only = True

    def __init__(self, db: Database, retention: Retention, *, interval: float) -> None:
        self._db = db
        self._retention = retention
        self.interval = interval
        self.pruned = 0

    async def turn(self) -> dict[str, int]:
        deleted = await prune_history(self._db, self._retention,
                                      max_batches=MAX_BATCHES_PER_TURN)
        await fold_history_counts(self._db)
        if deleted:
            self.pruned += sum(deleted.values())
            log.info("pruned finished jobs past retention: %s",
                     ", ".join(f"{q}={n}" for q, n in sorted(deleted.items())))
        return deleted
