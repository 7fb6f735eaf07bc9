"""A registered handler and its defaults; `Task.enqueue` is the decorator's shorthand."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from ._checks import check_task_name, parse_rate
from .errors import ConfigurationError
from .job import Job, OnParentFailure

if TYPE_CHECKING:
    from psycopg import AsyncConnection

Handler = Callable[[Job], Awaitable[object]] | Callable[[Job], object]
Backoff = Callable[[int], float]


class TaskOwner(Protocol):
    """What a Task needs of the Queue it is registered on: its `enqueue`, which takes the
    options `Task.enqueue` spells out. A Protocol, not Queue: queue.py imports this module,
    and importing it back would make the two modules a cycle."""

    async def enqueue(self, task: str | Task, *args: Any, **options: Any) -> int: ...


def name_of(task: object) -> str:
    """The name of a task given as its Task or its name; ConfigurationError for anything
    else, or for a name that cannot be a task's."""
    if isinstance(task, Task):
        return task.name
    if not isinstance(task, str):
        raise ConfigurationError(
            f"task={task!r}: pass the task's name (a string) or the Task object")
    check_task_name(task)
    return task


@dataclass(frozen=True)
class Task:
    """A registered handler with its defaults: what `@queue.task()` returns.

    Calling the Task calls the handler (`await send_email(job)` in a unit test of the
    handler itself); `await send_email.enqueue({...})` enqueues one of its jobs.

    Attributes:
        owner: the Queue it is registered on.
        name: the name stored with each job (`job.task`).
        handler: the function, `async def` or plain `def`, that takes the `Job`.
        queue: the queue its jobs go to unless an enqueue says otherwise (a task with limits:
            always, see `refuses`).
        max_attempts: attempts before a failing job is dead-lettered.
        timeout: seconds an attempt may run; None: no limit.
        priority: the default priority of its jobs; higher runs first.
        backoff: seconds before the next attempt, given the attempt that failed; None: the
            default, min(300, 2 ** attempt) plus up to 10 % jitter.
        concurrency_limit: at most this many of its jobs run at once across the fleet.
        key_limit: at most this many of its jobs with one `key` run at once.
        rate_limit: at most N starts per period across the fleet, e.g. "14/s".
    """

    owner: TaskOwner
    name: str
    handler: Handler
    queue: str = "default"
    max_attempts: int = 3
    timeout: float | None = None
    priority: int = 0
    backoff: Backoff | None = None
    concurrency_limit: int | None = None
    key_limit: int | None = None
    rate_limit: str | None = None

    @cached_property
    def is_async(self) -> bool:
        """Whether the handler is an `async def` (a plain `def` runs in a thread)."""
        # Cached: asked for every job the worker runs, and inspect's answer costs about
        # 1 us; the handler of a (frozen) Task never changes.
        return inspect.iscoroutinefunction(self.handler)

    @property
    def limits(self) -> dict[str, object] | None:
        """The task's limits as a claim sends them (0007_flow_control.sql), or None when
        the task has none."""
        found: dict[str, object] = {}
        if self.concurrency_limit is not None:
            found["c"] = self.concurrency_limit
        if self.key_limit is not None:
            found["k"] = self.key_limit
        if self.rate_limit is not None:
            found["r"] = list(parse_rate(self.rate_limit))
        return found or None

    def refuses(self, queue: str) -> str | None:
        """Why a job of this task cannot run in `queue`, or None when it can. A worker sends
        the limits of the tasks declared on the queues it serves (worker.py), so a limited
        task's job in another queue would run past its limits there."""
        if queue == self.queue or self.limits is None:
            return None
        return (f"task {self.name!r} has flow limits and runs in queue {self.queue!r}, whose "
                f"workers apply them, not in {queue!r}")

    async def enqueue(
        self,
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        dedup_key: str | None = None,
        key: str | None = None,
        conn: AsyncConnection[Any] | None = None,
        after: Sequence[int] | None = None,
        on_parent_failure: OnParentFailure = "cancel",
    ) -> int:
        """Enqueue one job of this task: `Queue.enqueue` with this task's name, the same
        arguments and the same return value (the job's id)."""
        return await self.owner.enqueue(
            self.name,
            {} if payload is None else payload,
            queue=queue,
            priority=priority,
            run_at=run_at,
            delay=delay,
            max_attempts=max_attempts,
            dedup_key=dedup_key,
            key=key,
            conn=conn,
            after=after,
            on_parent_failure=on_parent_failure,
        )

    def __call__(self, job: Job) -> object:
        """Call the handler directly (handy in unit tests of the handler itself)."""
        return self.handler(job)
