"""Runs one claimed job's handler and turns whatever happens into an Outcome."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from .._checks import encode_result
from ..errors import a_or_an
from ..hooks import Finished, Hooks, Middleware
from ..job import Fail, Job, Retry
from ..task import Backoff, Task
from .outcome import MAX_DELAY, Outcome, default_backoff
from .threads import ThreadRunner

log = logging.getLogger("asyncjobq.executor")

# The cancel reason of a job whose cancel Queue.cancel asked for: it ends `cancelled`.
CANCEL_REQUESTED = "cancel requested"


@dataclass
class RunningJob:
    job: Job
    started: float
    # The asyncio task running the handler. Plain asyncio tasks and asyncio.timeout, not an
    # anyio task group and cancel scopes: those cost ~20 us per job, a third of a zero-work
    # job's CPU in the worker (benchmarks/results/PROFILE.md).
    task: asyncio.Task[None] | None = None
    # Why the worker cancelled this handler, if it did ("shutdown", "lease lost").
    cancel_reason: str | None = None
    # Set when the worker is torn down: stop waiting for a sync body that is still running.
    abandoned: bool = False
    # Set when the attempt ends as interrupted by the worker (released, its run not judged).
    interrupted: bool = False
    # Set when a sync body ran to its end while the worker's shutdown waited for it.
    ran_to_end: bool = False
    # Set by the task's first step. A task cancelled before it is thrown the cancellation
    # before any of its code runs: no `finally` would free the job's slot, and the heartbeat
    # would renew a job nobody runs for ever. Until then, cancel() only records the reason,
    # which execute() reads first.
    begun: bool = False

    @property
    def called_off(self) -> bool:
        """Cancelled or abandoned: once seen at the task's first step, nothing of the job runs."""
        return self.cancel_reason is not None or self.abandoned

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        if self.task is not None and self.begun:
            self.task.cancel(reason)

    def abandon(self) -> None:
        self.abandoned = True
        if self.task is not None and self.begun:
            self.task.cancel("worker torn down")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _raised(job: Job, task: Task, exc: BaseException) -> Outcome:
    if isinstance(exc, Exception):
        log.warning("job %s (%s) attempt %s failed: %s", job.id, job.task, job.attempt,
                    _describe(exc), exc_info=log.isEnabledFor(logging.DEBUG))
    else:  # SystemExit, KeyboardInterrupt... from a handler: not the worker's
        log.warning("job %s (%s) attempt %s raised %s", job.id, job.task, job.attempt,
                    _describe(exc))
    return _failure(job, task, _describe(exc))


def _failure(job: Job, task: Task | None, error: str) -> Outcome:
    """A failed attempt: retry with backoff while attempts remain, else dead-letter."""
    message = f"attempt {job.attempt}: {error}"
    if job.attempt >= job.max_attempts:
        return Outcome(job.id, job.attempt, task=job.task, kind="failed", error=message)
    if task is None or task.backoff is None:
        delay = default_backoff(job.attempt)
    else:
        delay = _custom_backoff(job, task.backoff)
    return Outcome(job.id, job.attempt, task=job.task, kind="retry", delay=delay, error=message)


def _custom_backoff(job: Job, backoff: Backoff) -> float:
    # What a task's own backoff returns goes into the completer's flush with other jobs'
    # outcomes: a NaN there would fail the whole flush, every time it is tried again.
    try:
        delay: object = backoff(job.attempt)
    except Exception as e:
        log.warning("job %s (%s): its backoff raised %s; retrying on the default backoff "
                    "instead; fix the task's backoff", job.id, job.task, _describe(e))
        return default_backoff(job.attempt)
    if isinstance(delay, int | float) and not isinstance(delay, bool) and delay == delay:
        # Clamped before float(): an int past a float's range (10**400) would raise there.
        return float(min(max(0, delay), MAX_DELAY))  # below 0 means at once
    log.warning("job %s (%s): its backoff returned %r, not a number of seconds; retrying on "
                "the default backoff instead; fix the task's backoff", job.id, job.task, delay)
    return default_backoff(job.attempt)


async def _call(job: Job, running: RunningJob, task: Task, runner: ThreadRunner) -> object:
    if task.is_async:
        result = await task.handler(job)  # type: ignore[misc]
    else:
        result = await _in_thread(job, running, task, runner)
    # A sync callable that returned a coroutine; None, the common return, is not awaitable
    # (asked first: isawaitable costs about 1 us a job).
    if result is not None and inspect.isawaitable(result):
        result = await result
    return result


async def _call_through(middleware: tuple[Middleware, ...], running: RunningJob, task: Task,
                        runner: ThreadRunner) -> object:
    """The handler inside the middleware, outermost first (hooks.py)."""
    async def handler(job: Job) -> object:
        return await _call(job, running, task, runner)

    call: Callable[[Job], Awaitable[object]] = handler
    for mw in reversed(middleware):
        call = _wrap(mw, call)
    return await call(running.job)


def _wrap(mw: Middleware, call_next: Callable[[Job], Awaitable[object]],
          ) -> Callable[[Job], Awaitable[object]]:
    async def call(job: Job) -> object:
        if not isinstance(job, Job):
            raise TypeError(f"middleware {getattr(mw, '__qualname__', mw)!r} passed "
                            f"{a_or_an(type(job).__name__)} to call_next: pass the job")
        return await mw(job, call_next)

    return call


async def _run(running: RunningJob, task: Task, runner: ThreadRunner,
               hooks: Hooks | None) -> object:
    if hooks is None:
        return await _call(running.job, running, task, runner)
    if hooks.middleware:
        return await _call_through(hooks.middleware, running, task, runner)
    return await _call(running.job, running, task, runner)


def finished(outcome: Outcome | None, running: RunningJob) -> Finished:
    """What on_finished reports for an attempt (hooks.FINISHED)."""
    if outcome is None or running.interrupted:
        return "cancelled"  # its lease was lost, or the worker stopped and released it
    return {"done": "done", "retry": "retry", "snooze": "snoozed",
            "failed": "failed"}[outcome.kind]  # type: ignore[return-value]


async def _in_thread(job: Job, running: RunningJob, task: Task, runner: ThreadRunner,
                     ) -> object:
    """A sync body in a thread. Cancelled (timeout, shutdown, lease lost), it still waits for
    the body to return before letting the cancellation through: the job keeps its slot and its
    heartbeat meanwhile, and no other attempt of it can start while this one runs (a timed-out
    or released job would otherwise be claimed again beside its own running body). Only a
    worker being torn down stops waiting; its job is then reaped after the lease.

    A body that ran to its end while a shutdown waited for it is judged by what it returned or
    raised: released as interrupted, a job whose body finished would run a second time."""
    body = runner.submit(task.handler, job)
    cancelled: asyncio.CancelledError | None = None
    while not body.done():
        try:
            await asyncio.shield(body)
        except asyncio.CancelledError as e:
            if running.abandoned:
                raise
            if cancelled is None and not body.done():
                if running.cancel_reason == CANCEL_REQUESTED:
                    log.info("job %s (%s) attempt %s: cancel requested; a sync handler cannot "
                             "be interrupted, it sees job.cancel_requested and ends "
                             "cancelled when it returns", running.job.id, running.job.task,
                             running.job.attempt)
                else:
                    log.warning("job %s (%s) attempt %s: a sync handler cannot be "
                                "interrupted; waiting for it to return before its job is let "
                                "go", running.job.id, running.job.task, running.job.attempt)
            cancelled = e
        except BaseException:
            break  # the body's own exception, raised by body.result() below
    if cancelled is not None:
        if running.cancel_reason != "shutdown":
            raise cancelled  # a timeout or a lost lease: the executor judges it by that
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # the shutdown's cancel, answered by the body's own end
        running.ran_to_end = True
    return body.result()


async def execute(
    running: RunningJob, task: Task | None, registered: Iterable[str], runner: ThreadRunner,
    hooks: Hooks | None = None, max_result_bytes: int = 1_000_000,
) -> Outcome | None:
    """Run the handler. Returns None only when the lease was lost (nothing may be written)."""
    if running.called_off:
        if running.cancel_reason == CANCEL_REQUESTED:
            return _cancelled(running)
        return _unstarted(running)
    outcome = await _attempt(running, task, registered, runner, hooks, max_result_bytes)
    # Whatever a handler made of that cancellation (a Fail, a Retry, an error of its own, a
    # return), another attempt of the job may hold its row now: nothing of this one is written.
    if running.cancel_reason == "lease lost":
        return None
    # Likewise whatever it made of a cancel asked for while it ran: no retry follows a cancel.
    # A handler that returned before the cancel arrived is not here: its outcome stands.
    if running.cancel_reason == CANCEL_REQUESTED:
        return _cancelled(running)
    return outcome


def _cancelled(running: RunningJob) -> Outcome:
    job = running.job
    running.interrupted = True  # on_finished reports it as cancelled
    return Outcome(job.id, job.attempt, task=job.task, kind="cancelled",
                   error=f"attempt {job.attempt}: cancelled while running, as asked")


def _unstarted(running: RunningJob) -> Outcome | None:
    """The outcome of a job cancelled between its dispatch and its task's first step: its
    handler never ran. Let go for a lost lease, or torn down, nothing is written (the reaper
    takes it); stopped, it is released as interrupted."""
    if running.abandoned or running.cancel_reason == "lease lost":
        return None
    return _released(running)


def _released(running: RunningJob) -> Outcome:
    """Interrupted by the worker (stopped): back to queued at once, its run not judged."""
    job = running.job
    running.interrupted = True
    return Outcome(job.id, job.attempt, task=job.task, kind="retry", delay=0.0, error=(
        f"attempt {job.attempt}: interrupted by worker {running.cancel_reason}"))


async def _attempt(
    running: RunningJob, task: Task | None, registered: Iterable[str], runner: ThreadRunner,
    hooks: Hooks | None, max_result_bytes: int = 1_000_000,
) -> Outcome:
    job = running.job
    if task is None:
        names = ", ".join(repr(n) for n in sorted(registered)) or "none"
        log.warning("job %s: unknown task %r, failed without retrying; register it and run "
                    "retry-failed", job.id, job.task)
        return Outcome(job.id, job.attempt, task=job.task, kind="failed", error=(
            f"attempt {job.attempt}: unknown task {job.task!r}: this worker's registered tasks "
            f"are {names}; register it with @queue.task(name={job.task!r}) and run "
            "retry-failed"))
    if not isinstance(job.payload, dict):
        log.warning("job %s (%s): payload is not a JSON object, failed without retrying",
                    job.id, job.task)
        return Outcome(job.id, job.attempt, task=job.task, kind="failed", error=(
            f"attempt {job.attempt}: payload is {a_or_an(type(job.payload).__name__)}, not a "
            "JSON object; enqueue a dict"))
    timed_out = False
    interrupted = False
    result: object = None
    deadline: asyncio.Timeout | None = None
    try:
        if job.has_parents and job.control is not None:
            # A child of a workflow: its parents' results, read in the attempt (a failure to
            # read them is the attempt's, retried as any other).
            job.parent_results.update(await job.control.parent_results(job.id))
        if hooks is not None and hooks.on_started:
            # Outside the handler's timeout: a slow hook must not eat the handler's time.
            # Bounded by the hooks' own timeout (hooks.py).
            await hooks.emit("on_started", job=job)
        if task.timeout is None:
            # No asyncio.timeout at all: its enter and exit cost 1.7 us a job, a few per cent
            # of a zero-work job's CPU in the worker.
            result = await _run(running, task, runner, hooks)
        else:
            async with asyncio.timeout(task.timeout) as deadline:
                result = await _run(running, task, runner, hooks)
    except TimeoutError as e:
        if deadline is None or not deadline.expired():
            return _raised(job, task, e)  # the handler's own TimeoutError
        timed_out = True
    except Retry as r:
        return Outcome(job.id, job.attempt, task=job.task, kind="snooze", delay=r.delay)
    except Fail as f:
        return Outcome(job.id, job.attempt, task=job.task, kind="failed",
                       error=f"attempt {job.attempt}: Fail: {f.reason}")
    except asyncio.CancelledError:
        current = asyncio.current_task()
        # Timed out, then cancelled for another reason while a sync body was still being
        # waited for: asyncio.timeout lets the second cancellation through instead.
        timed_out = deadline is not None and deadline.expired()
        if running.cancel_reason is None:
            if current is not None and current.cancelling():
                raise  # the worker itself is being torn down: let the cancellation through
            log.warning("job %s (%s) attempt %s: handler raised CancelledError", job.id,
                        job.task, job.attempt)
            return _failure(job, task, "CancelledError raised by the handler")
        if running.abandoned:
            raise  # torn down: nothing is written, its row is reaped after the lease
        if current is not None:
            current.uncancel()  # our own cancel, turned into an outcome below
        interrupted = not timed_out
    except BaseException as e:
        return _raised(job, task, e)
    else:
        if running.cancel_reason is not None:
            # A sync body that returned while a shutdown waited for it (_in_thread) is judged by
            # its timeout, if that fired meanwhile; otherwise it is done. A handler that
            # swallowed the worker's cancel and returned is not known to be done: released.
            timed_out = deadline is not None and deadline.expired()
            interrupted = not timed_out and not running.ran_to_end
    if interrupted:
        return _released(running)
    if timed_out:
        log.warning("job %s (%s) attempt %s timed out after %s s", job.id, job.task, job.attempt,
                    task.timeout)
        return _failure(job, task, f"timed out after {task.timeout} s")
    return done(job, result, max_result_bytes)


def done(job: Job, result: object, max_result_bytes: int) -> Outcome:
    """A handler returned `result`: done, with the result as JSON (None stores nothing). A
    value that cannot be stored dead-letters the job at once, its run kept as it was: running
    it again would return the same value (docs/guides/results.md)."""
    if result is None:
        return Outcome(job.id, job.attempt, task=job.task, kind="done")
    try:
        text = encode_result(result, max_result_bytes)
    except ValueError as e:
        log.warning("job %s (%s) attempt %s: its result cannot be stored, failed without "
                    "retrying: %s", job.id, job.task, job.attempt, e)
        return Outcome(job.id, job.attempt, task=job.task, kind="failed", error=(
            f"attempt {job.attempt}: the handler returned, but {e}"))
    return Outcome(job.id, job.attempt, task=job.task, kind="done", result=text)
