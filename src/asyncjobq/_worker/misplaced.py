"""Jobs of a limited task claimed from a queue that is not the task's: moved, not run.

A worker sends the limits of the tasks declared on the queues it serves only (worker.py), and
Queue.enqueue puts a limited task's jobs into its own queue only (Task.refuses). A job written
into another queue all the same (`python -m asyncjobq enqueue`, whose Queue does not know the
task and defaults to `default`; SQL; a producer that does not register the task; a job already
there when the limits came) is claimed there without the task's limits. Run, it would pass
them; failed, a job enqueued in good faith would be dead-lettered. It is moved instead: queued
again in the task's queue, whose workers apply the limits, with the claim's attempt taken back
and its run_at kept, and that queue's workers are woken.
"""

from __future__ import annotations

import logging

import anyio

from .._db.database import Database
from .._db.retrying import RETRYABLE, RetryPolicy
from ..job import Job
from ..task import Task

log = logging.getLogger("asyncjobq.worker")


class Mover:
    def __init__(self, db: Database, worker_id: str) -> None:
        self._db = db
        self._worker_id = worker_id
        # Tasks whose moves this worker has logged at WARNING: one line per task, not per job
        # (a script enqueueing thousands from the CLI would flood the log).
        self._logged: set[str] = set()
        self.moved = 0
        self._retry = RetryPolicy(log, "moving a job to its task's queue")

    async def move(self, job: Job, task: Task) -> bool:
        """Move `job` (claimed by this worker, its handler not called) to `task.queue`; False
        when the job was no longer this worker's attempt (reaped, claimed again) and stays
        as that left it. Database errors are retried until the statement succeeds: the job
        stays running, heartbeated, meanwhile (its caller keeps it among the running jobs)."""
        params = {"id": job.id, "attempt": job.attempt, "worker": self._worker_id,
                  "queue": task.queue, "channel": self._db.channel}
        while True:
            try:
                async with self._db.connection() as conn:
                    # Twice when the first finds nothing: a statement of its own sees a move
                    # of the row by the leader's rotation that the first waited for
                    # (docs/how-it-works/storage.md).
                    for _ in range(2):
                        cur = await conn.execute(self._db.sql.job_move_to_task_queue, params)
                        row = await cur.fetchone()
                        if row is not None:
                            break
                self._retry.succeeded()
                break
            except RETRYABLE as e:
                await anyio.sleep(self._retry.failed(e, f"moving job {job.id} to {task.queue!r}"))
        if row is None:
            log.warning("job %s (%s) attempt %s: not moved to queue %r, the job is no longer "
                        "held by this worker (its lease expired and it was reaped); another "
                        "attempt owns it now", job.id, job.task, job.attempt, task.queue)
            return False
        self.moved += 1
        if job.task in self._logged:
            log.debug("job %s (%s): moved from queue %r to %r, attempt not counted", job.id,
                      job.task, job.queue, task.queue)
        else:
            self._logged.add(job.task)
            log.warning(
                "job %s (%s): moved from queue %r to %r without running, its attempt not "
                "counted: %s, and this worker does not serve %r. Enqueue the task's jobs into "
                "%r (the CLI's --queue, the queue argument of SQL enqueue); this worker moves "
                "further jobs of %r without logging each", job.id, job.task, job.queue,
                task.queue, task.refuses(job.queue), task.queue, task.queue, job.task)
        return True
