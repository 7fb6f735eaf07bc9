"""Runs one claimed job's handler and turns whatever happens into an Outcome."""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field

import anyio

from .job import Fail, Job, Retry
from .outcome import Outcome, default_backoff
from .task import Task

log = logging.getLogger("asyncjobq.worker")


@dataclass
class RunningJob:
    job: Job
    started: float
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    # Why the worker cancelled this handler, if it did ("shutdown", "lease lost").
    cancel_reason: str | None = None

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.scope.cancel()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _failure(job: Job, task: Task | None, error: str) -> Outcome:
    """A failed attempt: retry with backoff while attempts remain, else dead-letter."""
    message = f"attempt {job.attempt}: {error}"
    if job.attempt >= job.max_attempts:
        return Outcome(job.id, job.attempt, "failed", error=message)
    backoff = task.backoff if task and task.backoff else default_backoff
    delay = max(0.0, backoff(job.attempt))
    return Outcome(job.id, job.attempt, "retry", delay=delay, error=message)


async def execute(
    running: RunningJob, task: Task | None, registered: list[str], limiter: anyio.CapacityLimiter
) -> Outcome | None:
    """Run the handler. Returns None only when the lease was lost (nothing may be written)."""
    job = running.job
    if task is None:
        names = ", ".join(sorted(registered)) or "none"
        return Outcome(job.id, job.attempt, "failed", error=(
            f"attempt {job.attempt}: unknown task {job.task!r}: this worker's registered tasks "
            f"are {names}; register it with @queue.task(name={job.task!r}) and run "
            "retry-failed"))
    if not isinstance(job.payload, dict):
        return Outcome(job.id, job.attempt, "failed", error=(
            f"attempt {job.attempt}: payload is a {type(job.payload).__name__}, not a JSON "
            "object; enqueue a dict"))
    timed_out = False
    result: object = None
    try:
        with running.scope:
            with anyio.move_on_after(task.timeout) as deadline:
                if task.is_async:
                    result = await task.handler(job)  # type: ignore[misc]
                else:
                    result = await anyio.to_thread.run_sync(
                        task.handler, job, abandon_on_cancel=True, limiter=limiter
                    )
                if inspect.isawaitable(result):  # a sync callable that returned a coroutine
                    result = await result
            timed_out = deadline.cancelled_caught
    except Retry as r:
        return Outcome(job.id, job.attempt, "snooze", delay=r.delay)
    except Fail as f:
        return Outcome(job.id, job.attempt, "failed",
                       error=f"attempt {job.attempt}: Fail: {f.reason}")
    except asyncio.CancelledError:
        task_obj = asyncio.current_task()
        if task_obj is not None and task_obj.cancelling():
            raise  # the worker itself is being torn down: let the cancellation through
        log.warning("job %s (%s) attempt %s: handler raised CancelledError", job.id, job.task,
                    job.attempt)
        return _failure(job, task, "CancelledError raised by the handler")
    except Exception as e:
        log.warning("job %s (%s) attempt %s failed: %s", job.id, job.task, job.attempt,
                    _describe(e), exc_info=log.isEnabledFor(logging.DEBUG))
        return _failure(job, task, _describe(e))
    except BaseException as e:  # SystemExit, KeyboardInterrupt... from a handler: not the worker's
        log.warning("job %s (%s) attempt %s raised %s", job.id, job.task, job.attempt,
                    _describe(e))
        return _failure(job, task, _describe(e))
    if running.scope.cancelled_caught or running.cancel_reason is not None:
        if running.cancel_reason == "lease lost":
            return None
        return Outcome(job.id, job.attempt, "retry", delay=0.0, error=(
            f"attempt {job.attempt}: interrupted by worker {running.cancel_reason or 'stop'}"))
    if timed_out:
        return _failure(job, task, f"timed out after {task.timeout} s")
    if result is not None:
        log.debug("job %s (%s) returned %r; return values are ignored", job.id, job.task,
                  type(result).__name__)
    return Outcome(job.id, job.attempt, "done")
