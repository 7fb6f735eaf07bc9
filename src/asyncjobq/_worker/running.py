"""The worker's running jobs: the handlers it runs, and the rows it must fence and keep.

One `Running` per worker. Jobs are keyed by (id, attempt): after a lost lease this worker may
claim a job's next attempt while the old one is still being cancelled; each is counted and
fenced alone. What it answers, and why each answer is what it is:

- `leased()`, what the heartbeat renews: every attempt running here, and every attempt whose
  outcome is not written yet (its row is still `running` in the table). It is called from the
  heartbeat thread: `tuple()` copies the dict without running Python code, so the loop cannot
  change it mid-copy.
- `keep()`, what a release of lost claim rows (fetcher.py) must leave alone: the attempts
  leased, and those let go for a lost lease during the last 10 leases. A let-go job's row is
  the reaper's to take with its attempt counted; released uncounted, a job always cut off
  would run forever.
- `lease_lost()` and `cut_off()` cancel a handler with the reason "lease lost", for which the
  executor writes nothing, whatever the handler makes of it: another attempt of the job may
  hold its row now. `lease_lost()` cancels the attempts the heartbeat found taken;
  `cut_off()`, when no beat has landed for a lease, only the handlers that started more than a
  lease ago: a younger one was claimed within about a lease, its row not yet the reaper's.
- A handler cancelled before its task's first step never starts (`RunningJob.begun`): its task
  still runs, and the executor, seeing the reason, returns at once, so `finish()` frees its
  slot and the heartbeat stops renewing it.

`dispatch()` and `finish()` run once per job, tens of thousands of times a second: a dict
write and a task, a dict pop; no await, lock or cancel scope.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import anyio

from ..job import Job, log_fields
from .executor import CANCEL_REQUESTED, RunningJob

# The worker's own messages, under the logger its users already filter on.
log = logging.getLogger("asyncjobq.worker")

Key = tuple[int, int]  # (job id, attempt)

# Let-go jobs are left to the reaper for this many leases; by then it has long since taken
# them (a lease after their last beat, plus a reaper turn).
LET_GO_LEASES = 10


def _fields(r: RunningJob) -> dict[str, object]:
    """A log line's job fields (asyncjobq.logs), for lines about a job written on the loop."""
    job = r.job
    return log_fields(job.id, job.task, job.queue, job.attempt)


class Running:
    """The attempts a worker runs, those whose outcome it has not written, those it let go.

    Args:
        execute: runs one attempt as the task `dispatch()` starts, and calls `finish()` at its
            end, whatever happens (the worker's `_execute`).
        lease: the worker's lease, in seconds.
        pending: (id, attempt) of the outcomes not written yet (the completer's); called from
            the heartbeat thread too.
    """

    def __init__(self, execute: Callable[[RunningJob], Coroutine[Any, Any, None]], *,
                 lease: float, pending: Callable[[], list[Key]]) -> None:
        self._execute = execute
        self._lease = lease
        self._pending = pending
        self._jobs: dict[Key, RunningJob] = {}
        # (id, attempt) -> when: handlers given up for a lost lease, whose rows the reaper takes.
        self._let_go: dict[Key, float] = {}
        self._none_running: anyio.Event | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[RunningJob]:
        """A copy: the handlers may be cancelled, and end, while it is walked."""
        return iter(tuple(self._jobs.values()))

    def get(self, key: Key) -> RunningJob | None:
        return self._jobs.get(key)

    def jobs(self) -> list[Job]:
        return [r.job for r in self._jobs.values()]

    def tasks(self) -> list[str]:
        """The running jobs' task names, for the heartbeat thread's warnings (a tuple() copy,
        as in leased())."""
        return [r.job.task for r in tuple(self._jobs.values())]

    def describe(self) -> str:
        """'12 (send_email), 13 (resize)': the running jobs, for the shutdown's log lines."""
        return ", ".join(f"{r.job.id} ({r.job.task})" for r in self._jobs.values())

    # --- per job -------------------------------------------------------------------------

    def dispatch(self, job: Job) -> None:
        running = RunningJob(job, time.monotonic())
        self._jobs[job.id, job.attempt] = running
        running.task = asyncio.create_task(self._execute(running), name=f"asyncjobq job {job.id}")

    def finish(self, running: RunningJob) -> None:
        """The attempt's handler has ended (or never started): its slot is free."""
        job = running.job
        self._jobs.pop((job.id, job.attempt), None)
        if not self._jobs and self._none_running is not None:
            self._none_running.set()

    # --- shutdown ------------------------------------------------------------------------

    async def all_finished(self) -> None:
        self._none_running = anyio.Event()
        if self._jobs:
            await self._none_running.wait()

    def cancel_all(self, reason: str) -> None:
        for r in self:
            r.cancel(reason)

    def abandon_all(self) -> None:
        """The worker is torn down: stop waiting for anything, sync bodies included; their
        jobs stay running in the table until reaped."""
        for r in self:
            r.abandon()

    # --- fencing -------------------------------------------------------------------------

    def leased(self) -> list[Key]:
        """What the heartbeat renews: running here, or its outcome not written (any thread).

        A job moves from the first to the second as it ends (finish(), then the completer's
        add); one the two copies miss between them is renewed by the next beat, a third of a
        lease later."""
        return [*tuple(self._jobs), *self._pending()]

    def keep(self) -> list[Key]:
        """What a release of lost claim rows (fetcher.py) must leave alone: the jobs leased, and
        those let go for a lost lease, which are the reaper's to take with their attempt
        counted (released uncounted, a job always cut off would run forever)."""
        now = time.monotonic()
        for key, at in list(self._let_go.items()):
            if now - at > LET_GO_LEASES * self._lease:  # long since reaped
                del self._let_go[key]
        return [*self.leased(), *self._let_go]

    def lease_lost(self, lost: set[Key]) -> None:
        """The heartbeat found these attempts' rows no longer this worker's (reaped)."""
        for key in lost:
            r = self._jobs.get(key)
            # Once: a handler already cancelled (a shutdown, an earlier loss) keeps its reason.
            if r is not None and r.cancel_reason is None:
                self._let_go[key] = time.monotonic()
                log.warning("job %s (%s) attempt %s: lease lost (reaped while running); "
                            "cancelling the handler, its outcome will not be written", key[0],
                            r.job.task, key[1], extra=_fields(r))
                r.cancel("lease lost")

    def cancel_requested(self, ids: set[int] | None = None, keys: set[Key] | None = None,
                         ) -> None:
        """Queue.cancel asked for these jobs (by id, from its notification) or attempts (from
        the heartbeat's reply) to stop: their handlers are cancelled, and each ends
        `cancelled` (executor.CANCEL_REQUESTED). A job not running here (finished, its outcome
        on its way) is left to its outcome."""
        for key, r in list(self._jobs.items()):
            if (ids is not None and key[0] in ids) or (keys is not None and key in keys):
                if r.cancel_reason is None:
                    log.info("job %s (%s) attempt %s: cancel requested; cancelling the handler",
                             key[0], r.job.task, key[1], extra=_fields(r))
                    r.cancel(CANCEL_REQUESTED)

    def cut_off(self, silent_for: float) -> None:
        """No heartbeat has landed for a lease: the fleet presumes this worker dead and may
        reap its jobs at any moment, so the handlers whose lease has run out stop now."""
        expired = time.monotonic() - self._lease
        for (job_id, attempt), r in list(self._jobs.items()):
            # Called again each heartbeat TICK while the beats fail: what it has already
            # cancelled is skipped, its let-go time left as it was.
            if r.started < expired and r.cancel_reason is None:
                self._let_go[job_id, attempt] = time.monotonic()
                log.warning("job %s (%s) attempt %s: no heartbeat has reached the database for "
                            "%.0f s (lease %.0f s); presuming the lease lost and cancelling the "
                            "handler", job_id, r.job.task, attempt, silent_for, self._lease,
                            extra=_fields(r))
                r.cancel("lease lost")
