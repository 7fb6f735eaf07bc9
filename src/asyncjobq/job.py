"""What handlers see (Job), what `get` and `retry_failed` return (JobInfo, RetryResult), and what
handlers may raise."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

# A sanity bound far below where PostgreSQL's timestamps overflow (294276 AD): a longer delay
# would fail the statement that stores it (a completer's flush, with the whole batch in it).
MAX_DELAY = 10_000 * 365.25 * 86400.0


def is_delay(value: object) -> bool:
    """Seconds a job can be put off by: a finite number from 0 to MAX_DELAY."""
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and 0 <= value <= MAX_DELAY)


JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
STATUSES: tuple[JobStatus, ...] = ("queued", "running", "done", "failed", "cancelled")


@dataclass(frozen=True)
class Job:
    """One claimed attempt of a job, handed to its handler."""

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
class JobInfo:
    """A job's row as `Queue.get` reads it, from the live table or the history."""

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
    payload: dict[str, Any]
    key: str | None = None  # enqueue(key=...), see Queue.task(key_limit=)


class RetryResult(int):
    """What `Queue.retry_failed` did. It is the number of jobs requeued (an int, as it always
    was), and `skipped` counts the matching failed jobs it left failed because another job
    holds their dedup_key: a queued or running one, or a newer failed one requeued now (one
    job per key may be live). Retry them once that job has finished."""

    _skipped: int

    def __new__(cls, requeued: int = 0, skipped: int = 0) -> RetryResult:
        result = super().__new__(cls, requeued)
        result._skipped = skipped
        return result

    @property
    def requeued(self) -> int:
        return int(self)

    @property
    def skipped(self) -> int:
        return self._skipped

    def __repr__(self) -> str:
        return f"RetryResult(requeued={int(self)}, skipped={self._skipped})"


class Retry(Exception):
    """Raise in a handler to run the job again after `delay` seconds, not counted as an error."""

    def __init__(self, delay: float = 0.0, reason: str | None = None) -> None:
        if not is_delay(delay):
            raise ValueError(f"Retry(delay={delay!r}): use a number of seconds from 0 to "
                             "10,000 years")
        super().__init__(reason or f"retry in {delay} s")
        self.delay = float(delay)


class Fail(Exception):
    """Raise in a handler to fail the job at once, with no further attempts."""

    def __init__(self, reason: str = "failed by handler") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class JobSummary:
    """A job as `Queue.list_jobs` lists it: no payload, and `last_error` cut to its last 300
    characters, the newest attempt's (`Queue.get_detail` has all of both)."""

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
class JobPage:
    """One page of `Queue.list_jobs`, newest first. `next_before` is the `before=` of the next
    (older) page, None on the last one."""

    jobs: list[JobSummary]
    next_before: int | None


@dataclass(frozen=True)
class JobDetail(JobInfo):
    """A job as `Queue.get_detail` reads it: JobInfo, the worker that last held it
    (`locked_by`), when that worker last renewed its lock (running jobs only), and its
    dedup_key. The schema keeps the last attempt's error only (`last_error`)."""

    worker: str | None = None
    locked_at: datetime | None = None
    dedup_key: str | None = None
