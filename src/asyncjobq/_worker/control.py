"""What a worker lends the jobs it runs (job.JobControl): whether Queue.cancel asked for an
attempt to stop, where its progress goes, and its parents' results. One per worker, not one per
job: a job that uses none of them costs nothing."""

from __future__ import annotations

from typing import Any

from .._db.database import Database
from .executor import CANCEL_REQUESTED
from .progress import ProgressWriter
from .running import Running


class Control:
    def __init__(self, running: Running, progress: ProgressWriter, db: Database) -> None:
        self._running = running
        self._progress = progress
        self._db = db

    def cancel_requested(self, job_id: int, attempt: int) -> bool:
        # Any thread (sync handlers): one dict lookup.
        r = self._running.get((job_id, attempt))
        return r is not None and r.cancel_reason == CANCEL_REQUESTED

    def set_progress(self, job_id: int, attempt: int, value: str) -> None:
        self._progress.put(job_id, attempt, value)

    async def parent_results(self, job_id: int) -> dict[int, Any]:
        """What the parents of a job of a workflow returned, read as its attempt starts."""
        return await read_parent_results(self._db, job_id)

    def cancel_notified(self, payload: str) -> None:
        """A notification on <schema>_cancel: the id of a job whose cancel was asked for."""
        try:
            job_id = int(payload)
        except ValueError:
            return  # not Queue.cancel's: ignored
        self._running.cancel_requested(ids={job_id})


async def read_parent_results(db: Database, job_id: int) -> dict[int, Any]:
    """{parent id: its result} of a job with parents (None for a parent not done)."""
    async with db.connection() as conn:
        cur = await conn.execute(db.sql.job_parent_results, {"id": job_id})
        return {int(p): r for p, r in await cur.fetchall()}
