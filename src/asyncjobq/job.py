"""What handlers see (Job), what `get` and `retry_failed` return (JobInfo, RetryResult), and what
handlers may raise."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

# Retry checks its delay as an enqueue does; both names stay importable from here, where the
# worker machinery (_worker/outcome.py) takes them.
from ._checks import MAX_DELAY as MAX_DELAY
from ._checks import encode_stored
from ._checks import is_delay as is_delay
from .errors import ConfigurationError

JobStatus = Literal["waiting", "queued", "running", "done", "failed", "cancelled"]
STATUSES: tuple[JobStatus, ...] = ("waiting", "queued", "running", "done", "failed",
                                   "cancelled")
# The statuses Queue.stats names for every queue; `waiting` (workflows) only for a queue with
# waiting jobs, so that counts compared with a dict written before workflows still match.
ALWAYS_COUNTED: tuple[JobStatus, ...] = tuple(s for s in STATUSES if s != "waiting")


class StatusCounts(dict[str, int]):
    """One queue's {status: count}, as `Queue.stats` returns it: queued, running, done, failed
    and cancelled always, waiting once the queue has waiting jobs; any status reads as 0 when
    it is not there (`counts["waiting"]`)."""

    def __missing__(self, key: str) -> int:
        if key in STATUSES:
            return 0
        raise KeyError(key)


# What a job does when one of its parents is dead-lettered or cancelled (asyncjobq.workflow).
OnParentFailure = Literal["cancel", "run"]
# The statuses after which nothing more happens to a job (Queue.wait returns).
FINAL_STATUSES: frozenset[str] = frozenset({"done", "failed", "cancelled"})
# The largest progress value, as JSON text: progress is a small status, not a result.
MAX_PROGRESS_BYTES = 8192


class JobControl(Protocol):
    """What a worker lends the jobs it runs (_worker/control.py): their cancel requests and
    where their progress goes."""

    def cancel_requested(self, job_id: int, attempt: int) -> bool: ...

    def set_progress(self, job_id: int, attempt: int, value: str) -> None: ...

    async def parent_results(self, job_id: int) -> dict[int, Any]: ...


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
        parent_results: for a job enqueued with parents (`after=`, a workflow), each
            parent's id mapped to what its handler returned (None for a parent that returned
            None, and for one that did not end `done`: a child of
            `on_parent_failure="run"`); empty for a job without parents.
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
    # The worker's, for cancel_requested and set_progress; None outside a worker.
    control: JobControl | None = field(default=None, compare=False, repr=False)
    # True for a job enqueued with parents: its attempt reads their results first.
    has_parents: bool = field(default=False, compare=False, repr=False)
    parent_results: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def cancel_requested(self) -> bool:
        """True once `Queue.cancel` asked for this attempt to stop. An `async` handler is
        cancelled (it gets `asyncio.CancelledError`); a sync one cannot be interrupted and
        should read this between steps and return early. Either way the job ends
        `cancelled`, not retried."""
        c = self.control
        return c is not None and c.cancel_requested(self.id, self.attempt)

    async def set_progress(self, value: Any) -> None:
        """Store a small JSON value (a number, a dict...) as this job's progress, shown by
        `Queue.get`, the CLI's `get` and the dashboard. Writes are coalesced: the last value
        of each second is written, so calling it in a tight loop costs nothing. Outside a
        worker (`asyncjobq.testing.perform`) it only checks the value."""
        self.set_progress_nowait(value)

    def set_progress_nowait(self, value: Any) -> None:
        """`set_progress` for sync handlers (any thread)."""
        try:
            text = encode_stored(value, "the progress", MAX_PROGRESS_BYTES,
                                 str(MAX_PROGRESS_BYTES), "progress is a small status (a "
                                 "percentage, a step); return large values as the job's result")
        except ValueError as e:
            raise ConfigurationError(f"set_progress(): {e}") from None
        c = self.control
        if c is not None:
            c.set_progress(self.id, self.attempt, text)


def claimed_job(*, id: int, task: str, queue: str, payload: dict[str, Any], priority: int,
                attempt: int, max_attempts: int, run_at: datetime, created_at: datetime,
                worker: str, trace_context: dict[str, str] | None, control: JobControl | None,
                has_parents: bool) -> Job:
    """The Job of a claimed row, as `Job(...)` makes it (tests/test_worker.py checks that
    field by field): the fetcher makes one per job it claims, and a frozen dataclass's
    __init__ sets each field through object.__setattr__, 3.5 us a Job, where one update of
    its __dict__ takes about a third of that. Job has no __post_init__ for it to skip (the
    test checks that too)."""
    job = object.__new__(Job)
    job.__dict__.update(
        id=id, task=task, queue=queue, payload=payload, attempt=attempt,
        max_attempts=max_attempts, priority=priority, run_at=run_at, created_at=created_at,
        worker=worker, trace_context=trace_context, control=control, has_parents=has_parents,
        parent_results={})
    return job


# The job whose handler runs in this context (set by the worker for each attempt's task, and
# carried into a sync handler's thread): log lines say which job they are about
# (asyncjobq.logs).
current_job: ContextVar[Job | None] = ContextVar("asyncjobq_current_job", default=None)
# Whether a worker sets it: only once a log formatter reads it (asyncjobq.logs.JsonFormatter
# turns it on). Setting a context variable in each job's task cost ~1 us a job, a few per
# cent of a drain's worker CPU, for log lines nobody formats as JSON.
TRACK_CURRENT_JOB = False


def log_fields(job_id: int, task: str | None = None, queue: str | None = None,
               attempt: int | None = None) -> dict[str, object]:
    """`extra=` for a log line about a job, written outside its handler's context."""
    fields: dict[str, object] = {"job_id": job_id}
    for name, value in (("task", task), ("queue", queue), ("attempt", attempt)):
        if value is not None:
            fields[name] = value
    return fields


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
        status: waiting (for its parents), queued, running, done, failed or cancelled.
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
        result: what its handler returned (JSON), once it is done; None before, and when
            the handler returned None.
        progress: the last value its handler passed to `job.set_progress`, or None.
        cancel_requested: True while a running job's cancel is on its way to its worker.
        parents: the ids of the jobs it waits (or waited) for, smallest first (`Queue.get`
            and `get_detail` read them; `list_jobs` and `wait` leave them empty).
        children: the ids of the jobs that wait (or waited) for it, likewise.
    """

    # id ... finished_at: JobSummary's, in the order the statements select them.
    payload: dict[str, Any]
    key: str | None = None  # enqueue(key=...), see Queue.task(key_limit=)
    result: Any = None
    progress: Any = None
    cancel_requested: bool = False
    parents: tuple[int, ...] = ()
    children: tuple[int, ...] = ()

    @property
    def is_final(self) -> bool:
        """done, failed (dead-lettered) or cancelled: nothing more will happen to it."""
        return self.status in FINAL_STATUSES


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
