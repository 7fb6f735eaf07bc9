"""What handlers see (Job), what `get` and `retry_failed` return (JobInfo, RetryResult), and what
handlers may raise."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

# Retry checks its delay as an enqueue does; both names stay importable from here, where the
# worker machinery (_worker/outcome.py) takes them.
from ._checks import MAX_DELAY as MAX_DELAY
from ._checks import is_delay as is_delay

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
STATUSES: tuple[JobStatus, ...] = ("queued", "running", "done", "failed", "cancelled")


@dataclass(frozen=True)
class Job:
    """One claimed attempt of a job, handed to its handler.

    Attributes:
        id: the job's id, as `enqueue` returned it.
        task: the task's name.
        queue: the queue the job was claimed from.
        payload: the JSON object it was enqueued with.
        attempt: this attempt's number, from 1.
        max_attempts: the attempt after which a failure dead-letters the job (a `Retry`
            raises it by one, so that it costs no attempt).
        priority: the job's priority.
        run_at: when the job became due.
        created_at: when it was enqueued.
        worker: the id of the worker running this attempt (`locked_by`).
        trace_context: the W3C trace context (traceparent, tracestate) of the enqueue that
            wrote the job, as `asyncjobq.tracing` stored it; None when the producer did not
            trace.
    """

    id: int
    task: str
    queue: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    priority: int
    run_at: datetime
    created_at: datetime
    worker: str = field(default="", compare=False)
    # The W3C trace context (traceparent, tracestate) of the enqueue that wrote the job, as
    # asyncjobq.tracing stored it; None when the producer did not trace.
    trace_context: dict[str, str] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class JobSummary:
    """A job as `Queue.list_jobs` lists it: `JobInfo` without the payload and the key, and
    `last_error` cut to its last 300 characters, the newest attempt's (`Queue.get_detail` has
    all of them). The fields are `JobInfo`'s, which adds the other two."""

    id: int
    task: str
    queue: str
    status: JobStatus
    attempts: int
    max_attempts: int
    priority: int
    run_at: datetime
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class JobInfo(JobSummary):
    """A job's row as `Queue.get` reads it, from the live table or the history.

    Attributes:
        id: the job's id.
        task: the task's name.
        queue: the queue's name.
        status: queued, running, done, failed or cancelled.
        attempts: attempts started so far.
        max_attempts: attempts allowed before the job is dead-lettered.
        priority: the job's priority; higher runs first.
        run_at: when the job is (or was) due.
        last_error: what ended its attempts other than by success or `Retry`, one line
            each ("attempt N: ..."), oldest first, kept to its last 8,000 characters; None
            when there is none.
        created_at: when it was enqueued.
        finished_at: when it was done, cancelled or dead-lettered; None before.
        payload: the JSON object it was enqueued with.
        key: its flow-control key (`enqueue(key=...)`), or None.
    """

    # id ... finished_at: JobSummary's, in the order the statements select them.
    payload: dict[str, Any]
    key: str | None = None  # enqueue(key=...), see Queue.task(key_limit=)


class RetryResult(int):
    """What `Queue.retry_failed` did. It is the number of jobs requeued (an int, as it always
    was), and `skipped` counts the matching failed jobs it left failed because another job
    holds their dedup_key: a queued or running one, or a newer failed one requeued now (one
    job per key may be live). Retry them once that job has finished.

    Args:
        requeued: the number of jobs requeued.
        skipped: the number of matching jobs left failed.
    """

    _skipped: int

    def __new__(cls, requeued: int = 0, skipped: int = 0) -> RetryResult:
        result = super().__new__(cls, requeued)
        result._skipped = skipped
        return result

    @property
    def requeued(self) -> int:
        """The number of jobs requeued (the int's own value)."""
        return int(self)

    @property
    def skipped(self) -> int:
        """The number of matching failed jobs left failed: their dedup_key is taken."""
        return self._skipped

    def __repr__(self) -> str:
        return f"RetryResult(requeued={int(self)}, skipped={self._skipped})"


class Retry(Exception):
    """Raise in a handler to run the job again after `delay` seconds, not counted as an error.

    The attempt is not held against `max_attempts` (the job's `max_attempts` rises by one)
    and nothing is added to `last_error`; `on_finished` reports it as "snoozed".

    Args:
        delay: seconds from now, from 0 to 10,000 years; anything else is a `ValueError`.
        reason: the exception's message; default "retry in <delay> s".
    """

    def __init__(self, delay: float = 0.0, reason: str | None = None) -> None:
        if not is_delay(delay):
            raise ValueError(f"Retry(delay={delay!r}): use a number of seconds from 0 to "
                             "10,000 years")
        super().__init__(reason or f"retry in {delay} s")
        self.delay = float(delay)


class Fail(Exception):
    """Raise in a handler to fail the job at once, with no further attempts.

    The job is dead-lettered (status `failed`) whatever attempts remain, with
    "attempt N: Fail: <reason>" added to its `last_error`.

    Args:
        reason: why, kept as the `reason` attribute and in `last_error`.
    """

    def __init__(self, reason: str = "failed by handler") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class JobPage:
    """One page of `Queue.list_jobs`, newest first.

    Attributes:
        jobs: the page's jobs (`JobSummary`), newest first.
        next_before: the `before=` of the next (older) page; None on the last one.
    """

    jobs: list[JobSummary]
    next_before: int | None


@dataclass(frozen=True)
class JobDetail(JobInfo):
    """A job as `Queue.get_detail` reads it: `JobInfo`'s fields, and these.

    Attributes:
        worker: the worker that last held it (`locked_by`), or None.
        locked_at: when that worker last renewed its lock (running jobs only), or None.
        dedup_key: the job's dedup_key, or None.
    """

    worker: str | None = None
    locked_at: datetime | None = None
    dedup_key: str | None = None
