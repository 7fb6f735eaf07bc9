"""Hooks and middleware: how tools (metrics, tracing, your own code) watch and wrap jobs.

A hook is any object with one or more of these `async def` methods, called with keyword
arguments (docs/how-it-works/architecture.md lists where each fires):

    on_enqueued(job_ids, task, queue)        an enqueue (or enqueue_many) wrote these jobs; with
                                             conn= before the caller's transaction commits (a
                                             rollback leaves no job); not for a dedup_key that
                                             matched a live job
    on_claimed(jobs)                         a worker claimed these jobs
    on_started(job)                          just before the handler runs
    on_finished(job, outcome, duration)      the attempt ended: outcome is one of FINISHED
    on_reaped(job_ids)                       the leader's reaper took back jobs of dead workers
    on_leader_changed(worker_id)             this process saw the leader change (None: none)

A hook that raises, or takes longer than `Hooks.timeout` seconds (then it is cancelled), is
logged and never affects a job. Hooks run in tasks of their own, never in the claim, the
completion, the enqueue or a maintenance turn, except on_started, which is awaited just before
its handler (outside the handler's timeout), so that it can set up what the handler sees.
Middleware wraps each handler call,
outermost first: `async def mw(job, call_next): return await call_next(job)`; it may change
the job it passes on, swallow or replace the result, or raise (Retry, Fail or any error,
judged as the handler's own). With no hook and no middleware registered, the worker does no
extra work per job.

An observer (`add_observer`) has the same methods as plain `def`s, called inline at the
event, before the hooks' tasks start: for counters (asyncjobq.metrics) that a slow hook must
neither delay nor, past MAX_PENDING, drop. It must return at once; what it raises is logged.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from .errors import ConfigurationError
from .job import Job

log = logging.getLogger("asyncjobq.hooks")

# Hook calls in flight at most: past this (hooks far slower than the jobs they watch), further
# events are dropped and counted rather than held in memory without bound.
MAX_PENDING = 10_000

Finished = Literal["done", "retry", "snoozed", "failed", "cancelled"]
FINISHED: tuple[Finished, ...] = ("done", "retry", "snoozed", "failed", "cancelled")
EVENTS = ("on_enqueued", "on_claimed", "on_started", "on_finished", "on_reaped",
          "on_leader_changed")

CallNext = Callable[[Job], Awaitable[object]]
Middleware = Callable[[Job, CallNext], Awaitable[object]]


def _is_async(fn: object) -> bool:
    # An object whose __call__ is `async def` counts too (a middleware class).
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


class Hooks:
    """The hooks, observers and middleware registered on one Queue (`queue.hooks`).

    Attributes:
        timeout: seconds a hook call may take before it is cancelled and logged
            (default 10).
        dropped: hook events not delivered because `MAX_PENDING` (10,000) hook calls were
            still running.
        active: whether anything is registered; with nothing, the worker skips hooks.
    """

    def __init__(self) -> None:
        self.on_enqueued: list[Callable[..., object]] = []
        self.on_claimed: list[Callable[..., object]] = []
        self.on_started: list[Callable[..., object]] = []
        self.on_finished: list[Callable[..., object]] = []
        self.on_reaped: list[Callable[..., object]] = []
        self.on_leader_changed: list[Callable[..., object]] = []
        self.middleware: tuple[Middleware, ...] = ()
        # Whether anything is registered: the worker skips hooks altogether when not.
        self.active = False
        self.timeout = 10.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[tuple[int, str]] = set()
        self.dropped = 0  # events not delivered because MAX_PENDING calls were in flight
        self._dropped_logged = 0
        # event -> observers' methods, called inline; also in the event's list above, so that
        # the worker's `if hooks.on_finished:` sees them.
        self._inline: dict[str, list[Callable[..., object]]] = {}
        # The Hooks a copy() was made from (itself when none): what stays the same queue's
        # hooks across asyncjobq.testing's blocks (metrics.collector keys on it).
        self.origin: Hooks = self

    def copy(self) -> Hooks:
        """The same registrations in a Hooks of their own (asyncjobq.testing: what a test adds
        to the copy is gone with it)."""
        other = Hooks()
        for event in EVENTS:
            setattr(other, event, list(getattr(self, event)))
        other._inline = {e: list(m) for e, m in self._inline.items()}
        other.middleware = self.middleware
        other.active = self.active
        other.timeout = self.timeout
        other.origin = self.origin
        return other

    def add_hook(self, hook: object) -> None:
        """Register the `async def` event methods of `hook` (`Queue.add_hook`).

        Raises `ConfigurationError` when it has none of them, or when one is a plain `def`.
        """
        found = {e: getattr(hook, e) for e in EVENTS if callable(getattr(hook, e, None))}
        if not found:
            raise ConfigurationError(
                f"{hook!r} has none of the hook methods: define one or more of "
                f"{', '.join(EVENTS)} as `async def` methods")
        for event, method in found.items():
            if not _is_async(method):
                raise ConfigurationError(
                    f"{type(hook).__name__}.{event} is not a coroutine function: define it "
                    "with `async def`")
        for event, method in found.items():
            getattr(self, event).append(method)
        self.active = True

    def add_observer(self, observer: object) -> None:
        """Register the plain `def` event methods of `observer`, called inline at each event
        before the hooks' tasks start, so that a slow hook neither delays nor drops them
        (`asyncjobq.metrics` is one). They must return at once; what they raise is logged.
        A method registered already is not registered twice. Raises `ConfigurationError`
        when `observer` has none of the methods, or when one is an `async def`."""
        found = {e: getattr(observer, e) for e in EVENTS
                 if callable(getattr(observer, e, None))}
        if not found:
            raise ConfigurationError(
                f"{observer!r} has none of the hook methods: define one or more of "
                f"{', '.join(EVENTS)} as plain `def` methods")
        for event, method in found.items():
            if _is_async(method):
                raise ConfigurationError(
                    f"{type(observer).__name__}.{event} is a coroutine function: an observer's "
                    "methods are plain `def` (register async ones with add_hook)")
        for event, method in found.items():
            inline = self._inline.setdefault(event, [])
            if method not in inline:
                inline.append(method)
                getattr(self, event).append(method)
        self.active = True

    def _observe(self, event: str, kwargs: dict[str, Any]) -> bool:
        """Call the observers of `event`; True when it has hooks to run as well."""
        inline = self._inline.get(event)
        if not inline:
            return True
        for method in inline:
            try:
                method(**kwargs)
            except Exception as e:
                self._failed(method, e)
        return len(getattr(self, event)) > len(inline)

    def add_middleware(self, middleware: Middleware) -> None:
        """Append `middleware` to the chain, inside the middleware added before it
        (`Queue.add_middleware`); `ConfigurationError` unless it is an `async def`."""
        if not callable(middleware) or not _is_async(middleware):
            raise ConfigurationError(
                f"middleware {middleware!r} is not a coroutine function: use "
                "`async def mw(job, call_next): return await call_next(job)`")
        self.middleware = (*self.middleware, middleware)
        self.active = True

    async def emit(self, event: str, **kwargs: Any) -> None:
        """Call every hook of `event`, each within `timeout` seconds; what a hook raises is
        logged, never raised (only a cancellation of the caller itself goes through)."""
        if self._observe(event, kwargs):
            await self._emit_hooks(event, kwargs)

    async def _emit_hooks(self, event: str, kwargs: dict[str, Any]) -> None:
        inline = self._inline.get(event, ())
        for method in tuple(getattr(self, event)):
            if method in inline:
                continue
            try:
                async with asyncio.timeout(self.timeout) as deadline:
                    await method(**kwargs)
            except TimeoutError as e:
                if deadline.expired():
                    self._failed(method, e, f"took more than {self.timeout:g} s and was "
                                 "cancelled")
                else:
                    self._failed(method, e)
            except asyncio.CancelledError as e:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the caller is being cancelled, not just the hook
                self._failed(method, e)
            except BaseException as e:  # SystemExit, KeyboardInterrupt from a hook: still its
                self._failed(method, e)

    def _failed(self, method: Callable[..., object], e: BaseException,
                what: str | None = None) -> None:
        key = (id(method), type(e).__name__)
        first = key not in self._warned
        self._warned.add(key)
        # The first of each kind with its traceback; the rest at debug level, since a broken
        # hook fails for every job.
        log.log(logging.WARNING if first else logging.DEBUG,
                "hook %s %s (ignored, the job is not affected%s)",
                getattr(method, "__qualname__", repr(method)),
                what or f"raised {type(e).__name__}: {e}",
                "; repeats are logged at debug level" if first else "",
                exc_info=first and what is None)

    def spawn(self, event: str, **kwargs: Any) -> None:
        """emit() in a task of its own, from code that must not wait (claims, completions,
        enqueues, maintenance turns)."""
        if not self._observe(event, kwargs):
            return
        if len(self._tasks) >= MAX_PENDING:
            self.dropped += 1
            if self.dropped >= 2 * self._dropped_logged:  # 1, 2, 4, 8...: not once per event
                self._dropped_logged = self.dropped
                log.warning("%d hook event(s) dropped so far: %d hook calls are still running "
                            "(hooks slower than the jobs they watch); make the hooks faster or "
                            "hand their work to a queue of their own", self.dropped, MAX_PENDING)
            return
        task = asyncio.get_running_loop().create_task(self._emit_hooks(event, kwargs),
                                                       name=f"asyncjobq hook {event}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout: float) -> None:
        """Wait (up to `timeout`) for hooks spawned earlier, e.g. before a worker exits."""
        if self._tasks:
            await asyncio.wait(tuple(self._tasks), timeout=timeout)
