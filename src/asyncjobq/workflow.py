"""Workflows: jobs that wait for other jobs (docs/guides/workflows.md).

`queue.workflow()` collects jobs and the jobs they wait for (`add(..., after=[...])`), then
`enqueue()` writes all of them in one transaction: a few statements whatever their number. A
job with parents that have not ended is `waiting`; the transaction that writes its last
parent's outcome makes it `queued` (0012_workflows.sql). `Queue.enqueue(..., after=[ids])` is
a workflow of one job whose parents exist already.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from . import tracing
from ._checks import (
    check_conn,
    check_int,
    check_key,
    check_timing,
    encode_payload,
)
from ._db.inserter import write
from .errors import ConfigurationError
from .job import OnParentFailure
from .task import Task

if TYPE_CHECKING:
    from ._db.database import Conn
    from .queue import Queue

__all__ = ["OnParentFailure", "Step", "Workflow"]

_POLICIES = ("cancel", "run")

_UNSURE = ("look for the workflow's jobs (queue.get) before enqueueing it again: it may exist "
           "twice otherwise")


@dataclass(frozen=True, eq=False)
class Step:
    """A job added to a workflow, not enqueued yet: pass it in a later `add(after=[...])`.
    Its id is in the list `Workflow.enqueue` returns, at `step.index`."""

    index: int
    task: str
    _workflow: Workflow = field(repr=False)


@dataclass
class _Job:
    row: list[Any]  # enqueue_workflow()'s row (0012_workflows.sql), trace context unset
    parents: list[int | Step]
    run_on_failure: bool

    @property
    def task(self) -> str:
        return str(self.row[0])

    @property
    def queue(self) -> str:
        return str(self.row[2])


class Workflow:
    """Jobs that wait for other jobs, enqueued together (`Queue.workflow()`).

        wf = queue.workflow()
        a = wf.add(fetch, {"url": u})
        b = wf.add(resize, {"size": 64}, after=[a])
        c = wf.add(resize, {"size": 256}, after=[a])
        d = wf.add(publish, {}, after=[b, c])
        ids = await wf.enqueue()   # all or none, in one transaction (conn= joins yours)

    A parent is a `Step` added earlier to this workflow, or the id of a job that exists. A
    job runs once every parent is `done`. When a parent is dead-lettered or cancelled, its
    children are cancelled, and theirs (`on_parent_failure="cancel"`), or run anyway
    (`"run"`); a parent's retries are waited through.
    """

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self._jobs: list[_Job] = []
        self._enqueued = False

    def __len__(self) -> int:
        return len(self._jobs)

    def add(
        self,
        task: str | Task,
        payload: dict[str, Any] | None = None,
        *,
        after: Sequence[Step | int] = (),
        on_parent_failure: OnParentFailure = "cancel",
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        key: str | None = None,
    ) -> Step:
        """Add a job that runs once the jobs of `after` are done; returns its `Step`. The
        other arguments are `Queue.enqueue`'s (a workflow's jobs take no dedup_key)."""
        if self._enqueued:
            raise ConfigurationError("this workflow was enqueued already: build a new one with "
                                     "queue.workflow() for more jobs")
        name, q, prio, attempts = self._queue._defaults(task, queue, priority, max_attempts)
        body = encode_payload(payload)
        when, secs = check_timing(run_at, delay)
        check_key("key", key)
        if on_parent_failure not in _POLICIES:
            raise ConfigurationError(f"on_parent_failure={on_parent_failure!r}: use 'cancel' "
                                     "(the default: cancel it when a parent fails) or 'run'")
        parents = self._parents(after)
        row = [name, json.loads(body), q, prio,
               when.astimezone(UTC).isoformat() if when else None, secs, attempts, None, key]
        self._jobs.append(_Job(row, parents, on_parent_failure == "run"))
        return Step(len(self._jobs) - 1, name, self)

    def _parents(self, after: object) -> list[int | Step]:
        if isinstance(after, Step | int) or not isinstance(after, Iterable) or isinstance(
                after, str | bytes | dict):
            raise ConfigurationError(f"after={after!r}: pass a list of the parents (steps of "
                                     "this workflow, or ids of existing jobs)")
        out: list[int | Step] = []
        for p in after:
            if isinstance(p, Step):
                if p._workflow is not self:
                    raise ConfigurationError(
                        f"after=[{p!r}]: that step belongs to another workflow; a parent is a "
                        "step of this one, or the id of a job that exists (enqueue the other "
                        "workflow first and pass its ids)")
            else:
                check_int("after", p, bits=64)
            if p not in out:
                out.append(p)
        return out

    async def enqueue(self, *, conn: Conn | None = None) -> list[int]:
        """Write the workflow's jobs, all or none; returns their ids in the order they were
        added. With `conn=`, in that connection's transaction, as `Queue.enqueue(conn=)`
        writes: they exist, and run, only if it commits. An unknown parent id raises
        ConfigurationError and writes nothing."""
        check_conn(conn)
        if self._enqueued:
            raise ConfigurationError("this workflow was enqueued already: build a new one with "
                                     "queue.workflow()")
        if not self._jobs:
            return []
        self._enqueued = True  # a second call, even a concurrent one, writes nothing
        try:
            send = tracing.producer(self._jobs[0].task, self._jobs[0].queue, len(self._jobs))
            if send is None:
                ids = await self._write(conn, None)
            else:
                with send:
                    ids = await self._write(conn, send.context)
                    send.written(ids)
        except BaseException:
            self._enqueued = False
            raise
        hooks = self._queue.hooks
        if hooks.on_enqueued:
            groups: dict[tuple[str, str], list[int]] = {}
            for job, job_id in zip(self._jobs, ids, strict=True):
                groups.setdefault((job.task, job.queue), []).append(job_id)
            for (task, q), group in groups.items():
                hooks.spawn("on_enqueued", job_ids=group, task=task, queue=q)
        return ids

    def _encoded(self, trace: str | None) -> tuple[str, str]:
        """enqueue_workflow()'s two arguments (0012_workflows.sql): the jobs, the edges."""
        context = json.loads(trace) if trace is not None else None
        rows = [[*job.row[:7], context, job.row[8]] for job in self._jobs]
        edges = [[p.index, None, n, job.run_on_failure] if isinstance(p, Step)
                 else [None, p, n, job.run_on_failure]
                 for n, job in enumerate(self._jobs) for p in job.parents]
        return _json(rows), _json(edges)

    async def _write(self, conn: Conn | None, trace: str | None) -> list[int]:
        # One statement (enqueue_workflow), so write() runs it as any enqueue's INSERT: in
        # the caller's transaction on conn=, alone (all or none) otherwise, and says what a
        # failure leaves written.
        what = f"the workflow's {len(self._jobs)} jobs (all or none of them)"
        rows = await write(
            self._queue.database, conn, self._queue.sql.workflow_enqueue, self._encoded(trace),
            what=what, resend=False, advice=_UNSURE,
            denied=("grant the producer's role USAGE on the queue's schema and EXECUTE ON "
                    f"FUNCTION {self._queue.schema}.enqueue_workflow(jsonb, jsonb) "
                    "(docs/guides/roles.md, a role that enqueues workflows)"))
        unknown = sorted(int(i) for i, u in rows if u)
        if unknown:  # the function wrote nothing
            raise _unknown(unknown)
        return [int(i) for i, _ in rows]


def _unknown(ids: list[int]) -> ConfigurationError:
    many = len(ids) > 1
    return ConfigurationError(
        f"after= names job{'s' if many else ''} {', '.join(map(str, ids[:10]))}"
        f"{' and more' if len(ids) > 10 else ''}, which {'do' if many else 'does'} not exist "
        "(never enqueued, or pruned from history): nothing was written; pass ids that "
        "Queue.enqueue returned")


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
