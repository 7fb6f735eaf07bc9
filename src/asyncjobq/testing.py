"""Helpers for testing an app's jobs on a real PostgreSQL (docs/guides/testing.md).

A test, in short::

    async with isolated(app.queue) as q:          # a throwaway schema, installed and opened
        await signup(...)                         # the app enqueues through the same Queue
        await assert_enqueued(q, "send_welcome", {"user_id": 7})
        assert await drain(q) == {"done": 1, "retry": 0, "failed": 0, "snoozed": 0}

`drain` and `perform` run handlers through the worker's own executor (timeouts, Retry, Fail,
middleware, hooks), and `drain` writes each outcome with the worker's fenced completion
statement, so a job ends in the state a worker would leave it in. The pytest plugin
(asyncjobq.pytest_plugin, loaded by pytest through its `pytest11` entry point) gives the
`asyncjobq_isolated` fixture.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import anyio
import psycopg

from . import tracing
from ._checks import encode_payload, is_int
from ._db.dsn import check_dsn
from ._db.sql import Statements, statements

# The executor is the worker's own, not a copy: a test must see what a worker would do.
from ._worker.completer import encode_outcomes
from ._worker.control import read_parent_results
from ._worker.executor import RunningJob, execute, finished
from ._worker.outcome import Outcome as _Outcome
from ._worker.threads import ThreadRunner
from .errors import AsyncJobQError, ConfigurationError, a_or_an
from .hooks import CallNext
from .job import Job, JobInfo
from .queue import Queue
from .task import Task

__all__ = [
    "TEST_DSN_ENV",
    "Outcome",
    "assert_enqueued",
    "drain",
    "enqueued",
    "isolated",
    "perform",
    "refute_enqueued",
]

log = logging.getLogger("asyncjobq.testing")

#: The environment variable naming the test server (`isolated`, the pytest plugin).
TEST_DSN_ENV = "ASYNCJOBQ_TEST_DSN"
# A job run this many times by one drain is retrying at once forever (Retry(delay=0) on every
# attempt): the drain stops and says so instead of spinning until the test times out.
RUNS_PER_JOB_LIMIT = 100

Kind = Literal["retry", "snoozed", "failed"]


@dataclass(frozen=True)
class Outcome:
    """What `perform` returns when the handler did not complete: "retry" (it raised, attempts
    remain), "snoozed" (it raised Retry), "failed" (Fail, or its last attempt raised); `error`
    is the text a worker would append to last_error, `delay` the seconds until the next try."""

    kind: Kind
    error: str | None = None
    delay: float = 0.0


# --- isolated ------------------------------------------------------------------------------

@asynccontextmanager
async def isolated(queue: Queue, *, dsn: str | None = None) -> AsyncIterator[Queue]:
    """Bind `queue` (the app's own object) to a fresh schema, installed and opened, for the
    block; then close it, drop the schema and point the queue back where it was. An async
    context manager: `async with isolated(app.queue) as q:` (`q` is `queue`).

    The server is `dsn`, else $ASYNCJOBQ_TEST_DSN, else the queue's own DSN (its argument,
    $ASYNCJOBQ_DSN or the embedded server). The queue's connections put the schema first in
    their search_path, so tables the app creates through `queue.connection()` land in it and
    go with it.
    """
    if not isinstance(queue, Queue):
        raise ConfigurationError(
            f"isolated() takes the app's asyncjobq.Queue, got {a_or_an(type(queue).__name__)}: "
            "pass the Queue object your tasks are registered on")
    if queue.database.is_open:
        raise ConfigurationError(
            f"isolated() needs {queue!r} closed, but it is open: enter isolated() before the "
            "app opens it (before its lifespan starts), or `await queue.close()` first")
    if dsn is not None and not isinstance(dsn, str):
        raise ConfigurationError(f"dsn={dsn!r}: pass a PostgreSQL DSN string, or None")
    server = dsn or os.environ.get(TEST_DSN_ENV) or queue.dsn
    schema = f"asyncjobq_test_{uuid.uuid4().hex[:16]}"
    check_dsn(server)  # a typo is a ConfigurationError, not a failed connection
    st = statements(schema)
    bound = psycopg.conninfo.make_conninfo(
        server, options=_search_path_first(server, schema, await _search_path(server, st)))
    with queue.bound_to(bound, schema):
        failed = False
        try:
            await queue.open()
            # Open for the whole block: an app lifespan that opens and closes the queue inside
            # the test (its open() finds it open) must not close it under the test.
            queue._kept_open = True
            await queue.install()
            yield queue
        except BaseException:
            failed = True
            raise
        finally:
            queue._kept_open = False
            # Shielded: a test's own timeout landing here must not leave the queue open on the
            # test schema, which every later isolated() of the session would then refuse.
            with anyio.CancelScope(shield=True):
                try:
                    await queue.close()
                finally:
                    await queue.database.close()  # closed even if close() failed midway
                    await _drop_or_say(server, st, failed)


async def _search_path(dsn: str, st: Statements) -> str:
    """The search_path the DSN's connections get (its options, the role's or database's
    settings), for the test schema to go first in, not to replace."""
    try:
        async with await psycopg.AsyncConnection.connect(dsn, connect_timeout=10) as conn:
            cur = await conn.execute(st.search_path_show)
            row = await cur.fetchone()
    except psycopg.OperationalError as e:
        raise ConfigurationError(
            f"cannot connect to the test server ({str(e).strip()}): check "
            "$ASYNCJOBQ_TEST_DSN (or dsn=) and that PostgreSQL runs") from None
    return str(row[0]) if row else "public"


def _search_path_first(dsn: str, schema: str, current: str) -> str:
    options = psycopg.conninfo.conninfo_to_dict(dsn).get("options") or ""
    # The server's own text, untouched: a quoted name may hold commas and spaces. libpq splits
    # options on spaces: a backslash keeps one inside the value.
    path = f"{schema}, {current}" if current.strip() else schema
    path = path.replace("\\", "\\\\").replace(" ", "\\ ")
    return f"{options} -c search_path={path}".strip()


async def _drop_or_say(server: str, st: Statements, failed: bool) -> None:
    schema = st.schema
    try:
        await _drop_schema(server, st)
    except psycopg.Error as e:
        if failed:
            # The test's own error is the one to see; the schema is only litter.
            log.warning("could not drop test schema %s: %s", schema, e)
            return
        raise AsyncJobQError(
            f"isolated(): could not drop the test schema {schema} ({str(e).strip()}): close "
            "the connections and stop the workers the test opened before its block ends, then "
            f"DROP SCHEMA {schema} CASCADE") from None


async def _drop_schema(dsn: str, st: Statements) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                     connect_timeout=10) as conn:
        # A worker the test left running may hold locks on its tables: wait a little, not
        # forever (the test reports its own failure; a leftover schema is only litter).
        async with conn.transaction():
            await conn.execute(st.local_lock_timeout_5s)
            await conn.execute(st.schema_drop)


# --- enqueued, assert_enqueued, refute_enqueued --------------------------------------------

async def enqueued(q: Queue, task: str | Task | None = None, *, queue: str | None = None,
                   conn: psycopg.AsyncConnection[Any] | None = None) -> list[JobInfo]:
    """The queued jobs (due or not), oldest first, of `task` and `queue` when given. With
    `conn=`, as that connection sees them: its own uncommitted enqueues included."""
    _check_queue(q, "enqueued")
    name = _task_name(task, required=False)
    _check_optional_str("queue", queue)
    _check_conn(conn)
    query = q.sql.job_list_queued
    params = {"task": name, "queue": queue}
    with q.translate_errors():
        if conn is not None:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
        else:
            async with q.connection() as c:
                cur = await c.execute(query, params)
                rows = await cur.fetchall()
    return [JobInfo(*row) for row in rows]


async def assert_enqueued(q: Queue, task: str | Task, payload: Mapping[str, Any] | None = None,
                          queue: str | None = None,
                          conn: psycopg.AsyncConnection[Any] | None = None) -> JobInfo:
    """Fail (AssertionError) unless a queued job of `task` exists whose payload contains
    `payload` (as JSON: each key with an equal value, a dict's keys as a subset in turn, true
    never equal to 1; and in `queue`, when given); returns the oldest such job. With `conn=`,
    the caller's uncommitted transaction counts."""
    __tracebackhide__ = True  # pytest: the failure is the test's line, not this helper's
    found, matching, name, wanted = await _matching(q, "assert_enqueued", task, payload, queue,
                                                    conn)
    if matching:
        return matching[0]
    raise AssertionError(
        f"expected {_describe(name, wanted, queue)} to be enqueued{_where(conn)}, but "
        f"{_listing(found)}{_unknown(q, name)}")


async def refute_enqueued(q: Queue, task: str | Task, payload: Mapping[str, Any] | None = None,
                          queue: str | None = None,
                          conn: psycopg.AsyncConnection[Any] | None = None) -> None:
    """Fail (AssertionError) if a queued job matches, as `assert_enqueued` matches them
    (queued only: a job already run or failed is not enqueued)."""
    __tracebackhide__ = True
    _, matching, name, wanted = await _matching(q, "refute_enqueued", task, payload, queue, conn)
    if matching:
        raise AssertionError(
            f"expected {_describe(name, wanted, queue, 'no')} to be enqueued{_where(conn)}, but "
            f"found {len(matching)}:\n{_lines(matching)}")


async def _matching(q: Queue, what: str, task: str | Task, payload: Mapping[str, Any] | None,
                    queue: str | None, conn: psycopg.AsyncConnection[Any] | None,
                    ) -> tuple[list[JobInfo], list[JobInfo], str, dict[str, Any]]:
    _check_queue(q, what)
    name = _task_name(task, required=True)
    assert name is not None
    wanted = _as_json(_check_payload(payload))
    _check_optional_str("queue", queue)
    found = await enqueued(q, queue=None, conn=conn)
    return found, [j for j in found if _matches(j, name, wanted, queue)], name, wanted


def _matches(job: JobInfo, task: str | None, payload: dict[str, Any], queue: str | None,
             ) -> bool:
    if task is not None and job.task != task:
        return False
    if queue is not None and job.queue != queue:
        return False
    return _contains(job.payload, payload)


def _contains(stored: object, wanted: object) -> bool:
    """JSON containment: a dict's keys as a subset (at any depth), lists element by element,
    numbers by value (1 == 1.0, as JSON has one number type), true and false only themselves."""
    if isinstance(wanted, dict):
        return isinstance(stored, dict) and all(
            k in stored and _contains(stored[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(stored, list) and len(stored) == len(wanted) and all(
            _contains(a, b) for a, b in zip(stored, wanted, strict=True))
    if isinstance(wanted, bool) or isinstance(stored, bool):
        return type(stored) is type(wanted) and stored == wanted
    if type(wanted) in _NUMBERS:
        return type(stored) in _NUMBERS and stored == wanted
    return stored == wanted


_NUMBERS = (int, float)


def _as_json(payload: Mapping[str, Any]) -> dict[str, Any]:
    """`payload` as a job would carry it: through enqueue's own encoder (its refusals
    included) and back, so tuples become lists and keys strings."""
    decoded: dict[str, Any] = json.loads(encode_payload(dict(payload)))
    return decoded


def _describe(task: str | None, payload: Mapping[str, Any], queue: str | None,
              article: str = "a") -> str:
    text = f"{article} job of task {task!r}"
    if queue is not None:
        text += f" in queue {queue!r}"
    if payload:
        text += f" with payload containing {dict(payload)!r}"
    return text


def _where(conn: object) -> str:
    return " (as seen by the given connection)" if conn is not None else ""


def _lines(jobs: Sequence[JobInfo]) -> str:
    return "\n".join(f"  #{j.id} task={j.task!r} queue={j.queue!r} payload={j.payload!r}"
                     + (f" run_at={j.run_at.isoformat()}" if j.run_at > datetime.now(UTC)
                        else "")
                     for j in jobs)


def _listing(jobs: Sequence[JobInfo]) -> str:
    if not jobs:
        return "no job is enqueued"
    return f"the {len(jobs)} enqueued job(s) are:\n{_lines(jobs)}"


def _unknown(q: Queue, name: str | None) -> str:
    if name is None or name in q.tasks:
        return ""
    known = ", ".join(sorted(q.tasks)) or "none"
    return (f"\n(note: no task {name!r} is registered on this queue; registered: {known}; "
            "pass the Task object to avoid a misspelt name)")


# --- perform -------------------------------------------------------------------------------

async def perform(q: Queue, task: str | Task, payload: Mapping[str, Any] | None = None, *,
                  attempt: int = 1) -> Any:
    """Run one handler now, as a worker would run attempt `attempt` of a job (its timeout,
    Retry and Fail, the queue's middleware and its on_started/on_finished hooks), without the
    database queue. Returns the handler's value (what the middleware passed back) when it
    completed, else an `Outcome` saying how it ended."""
    if not isinstance(q, Queue):
        raise ConfigurationError(
            f"perform() takes the app's asyncjobq.Queue first, got "
            f"{a_or_an(type(q).__name__)}")
    name = _task_name(task, required=True)
    assert name is not None
    t = q.tasks.get(name)
    if t is None:
        known = ", ".join(sorted(q.tasks)) or "none"
        raise ConfigurationError(
            f"perform(): task {name!r} is not registered on this queue (registered: {known}): "
            "pass the Task object, or register the handler with @queue.task()")
    # What a worker would hand the handler: the payload through enqueue's own encoder (its
    # refusals included) and back, never the caller's objects.
    body = _as_json(_check_payload(payload))
    if not is_int(attempt) or attempt < 1:
        raise ConfigurationError(f"attempt={attempt!r}: use 1 (the first) or more")
    now = datetime.now(UTC)
    job = Job(id=0, task=t.name, queue=t.queue, payload=body, attempt=attempt,
              max_attempts=max(t.max_attempts, attempt), priority=t.priority, run_at=now,
              created_at=now, worker="asyncjobq.testing")
    returned: list[object] = []

    async def capture(job: Job, call_next: CallNext) -> object:
        value = await call_next(job)
        returned.append(value)
        return value

    # Outermost, so that it sees what the app's middleware passed back.
    hooks = q.hooks.copy()
    hooks.middleware = (capture, *(tracing.instrument_worker(q.hooks.middleware)
                                   or q.hooks.middleware))
    hooks.active = True
    outcome = await _attempt(q, hooks, job, t, "asyncjobq-testing-perform")
    assert outcome is not None
    if outcome.kind == "done":
        return returned[0] if returned else None
    if outcome.kind == "cancelled":  # nothing cancels a perform()
        raise AssertionError("perform(): cancelled")
    kind: Kind = "snoozed" if outcome.kind == "snooze" else outcome.kind
    return Outcome(kind, outcome.error, outcome.delay)


async def _attempt(q: Queue, hooks: Any, job: Job, task: Task | None, thread_name: str,
                   ) -> _Outcome | None:
    runner = ThreadRunner(thread_name)
    running = RunningJob(job, time.monotonic())
    outcome: _Outcome | None = None
    try:
        outcome = await execute(running, task, q.tasks, runner, hooks if hooks.active else None,
                                q.max_result_bytes)
    finally:
        runner.close()
        if hooks.on_finished:
            # Awaited, not spawned as a worker does: the test reads what the hooks saw next.
            await hooks.emit("on_finished", job=job, outcome=finished(outcome, running),
                             duration=time.monotonic() - running.started)
    return outcome


# --- drain ---------------------------------------------------------------------------------

async def drain(q: Queue, queues: str | Sequence[str] | None = None,
                max_jobs: int | None = None, *,
                until: datetime | timedelta | None = None) -> dict[str, int]:
    """Run every due job (of `queues`, default all) in this process, one at a time in claim
    order (priority, run_at, id), until none is due; jobs that fail or Retry run again as soon
    as they are due. Returns how the attempts ended: {"done", "retry", "failed", "snoozed"}.

    A job is due when its run_at has come, by the server's clock; `until=` (a datetime, or a
    timedelta from now) makes jobs due up to then, so delayed jobs and retries after their
    backoff run too. `max_jobs` stops after that many attempts.
    """
    _check_queue(q, "drain")
    names = _check_queues(queues)
    if max_jobs is not None and (not is_int(max_jobs) or max_jobs < 1):
        raise ConfigurationError(f"max_jobs={max_jobs!r}: use a number of attempts >= 1, or "
                                 "None for no limit")
    horizon = _horizon(until)
    worker = f"asyncjobq-testing-drain-{uuid.uuid4().hex[:8]}"
    claim = q.sql.job_claim_one_for_drain
    params = {"worker": worker, "queues": names, "until": horizon,
              "ahead": until.total_seconds() if isinstance(until, timedelta) else None}
    # The worker's tracing middleware too (tracing.py), when a tracer provider is set.
    hooks = q.hooks
    traced = tracing.instrument_worker(hooks.middleware)
    if traced is not None:
        hooks = hooks.copy()
        hooks.middleware, hooks.active = traced, True
    counts = {"done": 0, "retry": 0, "failed": 0, "snoozed": 0}
    runs: dict[int, int] = {}
    ran = 0
    while max_jobs is None or ran < max_jobs:
        with q.translate_errors():
            async with q.connection() as conn:
                cur = await conn.execute(claim, params)
                row = await cur.fetchone()
        if row is None:
            break
        job = Job(id=row[0], task=row[1], queue=row[2], payload=row[3], priority=row[4],
                  attempt=row[5], max_attempts=row[6], run_at=row[7], created_at=row[8],
                  worker=worker, trace_context=row[9])
        if row[10] is not None:  # a child of a workflow: its parents' results
            with q.translate_errors():
                job.parent_results.update(await read_parent_results(q.database, job.id))
        runs[job.id] = runs.get(job.id, 0) + 1
        if runs[job.id] > RUNS_PER_JOB_LIMIT:
            await _write(q, worker, _Outcome(job.id, job.attempt, "snooze", 0.0, task=job.task))
            raise AsyncJobQError(
                f"drain: job {job.id} ({job.task}) ran {RUNS_PER_JOB_LIMIT} times in this drain "
                "and is due again at once (a handler raising Retry(delay=0) every time?): give "
                "the Retry a delay, or pass max_jobs= to bound the drain")
        if hooks.on_claimed:
            await hooks.emit("on_claimed", jobs=[job])
        outcome = await _attempt(q, hooks, job, q.tasks.get(job.task), worker)
        assert outcome is not None  # a drain never loses its lease: nothing reaps it
        await _write(q, worker, outcome)
        counts["snoozed" if outcome.kind == "snooze" else outcome.kind] += 1
        ran += 1
    return counts


async def _write(q: Queue, worker: str, o: _Outcome) -> None:
    params = {"outcomes": encode_outcomes([o]), "worker": worker, "channel": q.channel,
              "done": q.database.done_channel}
    async with q.connection() as conn:
        await conn.execute(q.sql.job_set_outcome_if_running_many, params)


def _horizon(until: object) -> datetime | None:
    if until is None:
        return None
    if isinstance(until, timedelta):
        return None  # added to the server's now() in the claim
    if isinstance(until, datetime):
        if until.tzinfo is None or until.utcoffset() is None:
            raise ConfigurationError(
                f"until={until!r} has no timezone: use e.g. datetime.now(timezone.utc) + "
                "timedelta(hours=1), or pass a timedelta")
        return until
    raise ConfigurationError(
        f"until={until!r}: pass a datetime with a timezone, or a timedelta from now (e.g. "
        "until=timedelta(hours=1) runs jobs due within the hour)")


# --- argument checks -----------------------------------------------------------------------

def _check_queue(q: object, what: str) -> None:
    if not isinstance(q, Queue):
        raise ConfigurationError(
            f"{what}() takes the asyncjobq.Queue first, got {a_or_an(type(q).__name__)}: pass "
            "the queue `isolated()` yielded")


def _task_name(task: object, *, required: bool) -> str | None:
    if task is None and not required:
        return None
    if isinstance(task, Task):
        return task.name
    if isinstance(task, str) and task:
        return task
    raise ConfigurationError(
        f"task={task!r}: pass the Task object (what @queue.task() returned) or its name")


def _check_payload(payload: object) -> Mapping[str, Any]:
    if payload is None:
        return {}
    if not isinstance(payload, Mapping):
        raise ConfigurationError(
            f"payload={payload!r}: pass a dict of the keys the job's payload must have (e.g. "
            "{'user_id': 7}), or None")
    return payload


def _check_optional_str(what: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigurationError(f"{what}={value!r}: pass a {what} name (a string), or None")


def _check_queues(queues: object) -> list[str] | None:
    if queues is None:
        return None
    if isinstance(queues, str):
        return [queues]
    if isinstance(queues, Sequence) and queues and all(isinstance(n, str) for n in queues):
        return list(queues)
    raise ConfigurationError(
        f"queues={queues!r}: pass a queue name, a list of names, or None for every queue")


def _check_conn(conn: object) -> None:
    if conn is not None and not isinstance(conn, psycopg.AsyncConnection):
        raise ConfigurationError(
            f"conn= takes a psycopg.AsyncConnection, got {a_or_an(type(conn).__name__)}: pass "
            "the connection whose transaction enqueued the job, or None")

