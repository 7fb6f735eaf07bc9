"""Retention: deletes finished jobs from jobs_history once older than their queue's retention,
and folds the shards of history's counts (0003_history_counts.sql).

Pruning runs in bounded batches, each its own short transaction, so it never holds locks for
long nor a snapshot that would stop vacuum. Failed (dead-lettered) jobs are never pruned by
age; `prune_failed` deletes them only when asked to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import anyio.lowlevel

from .._db.database import Database
from ..errors import ConfigurationError
from .services import Service

log = logging.getLogger("asyncjobq.pruner")

DEFAULT_RETENTION = timedelta(days=1)
PRUNE_BATCH = 5000
# Per maintenance turn; a backlog bigger than this is worked off over the next turns.
MAX_BATCHES_PER_TURN = 20

Age = float | timedelta | None


def seconds(what: str, age: Age) -> float | None:
    """A retention as seconds (None keeps forever); refuses what is not a positive duration."""
    if age is None:
        return None
    if isinstance(age, timedelta):
        value = age.total_seconds()
    elif isinstance(age, int | float) and not isinstance(age, bool):
        value = float(age)
    else:
        raise ConfigurationError(
            f"{what}={age!r}: use a timedelta or a number of seconds > 0, or None to keep "
            "finished jobs forever")
    if not value > 0:
        raise ConfigurationError(f"{what}={age!r}: use a duration greater than 0")
    return value


@dataclass(frozen=True)
class Retention:
    """How long finished (done, cancelled) jobs stay in history, by default and per queue."""

    default: float | None
    per_queue: tuple[tuple[str, float | None], ...] = ()

    @classmethod
    def of(cls, default: Age, per_queue: Mapping[str, Age] | None = None) -> Retention:
        if per_queue is not None and not isinstance(per_queue, Mapping):
            raise ConfigurationError(
                f"queue_retention={per_queue!r}: use a dict of queue name -> duration")
        pairs = tuple(sorted((str(q), seconds(f"queue_retention[{q!r}]", a))
                             for q, a in (per_queue or {}).items()))
        return cls(seconds("retention", default), pairs)

    @property
    def min_age(self) -> float | None:
        ages = [a for a in (self.default, *(a for _, a in self.per_queue)) if a is not None]
        return min(ages) if ages else None

    def params(self, limit: int) -> dict[str, Any]:
        return {"queues": [q for q, _ in self.per_queue], "ages": [a for _, a in self.per_queue],
                "default_age": self.default, "min_age": self.min_age, "limit": limit}


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
