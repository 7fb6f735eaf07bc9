"""The public Queue: task registry, enqueue, and the admin calls (get, stats, retry, cancel)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from types import TracebackType
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool

from . import tracing
from ._checks import (
    check_conn,
    check_dedup_key,
    check_flow_limit,
    check_int,
    check_key,
    check_limit,
    check_max_attempts,
    check_name,
    check_queue_name,
    check_task_name,
    check_text_filter,
    check_timeout,
    check_timing,
    encode_keys,
    encode_payload,
    encode_payload_array,
    int_between,
    is_number,
    is_positive,
    parse_rate,
)
from ._db import migrations
from ._db.database import NOT_OPEN, Conn, Database
from ._db.dsn import check_dsn, validate_schema
from ._db.inserter import Inserter, PartitionWriter, write
from ._db.sql import Statement, Statements
from ._maintenance.periodic import (
    Clock,
    Every,
    cron_clock,
    every_seconds,
    timezone_of,
)
from ._maintenance.pruner import DEFAULT_RETENTION, prune_failed, prune_history
from ._waiting import Waiter
from .errors import (
    AsyncJobQError,
    ConfigurationError,
    InvalidPayloadError,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    QueueClosedError,
    RetryRaceError,
    reason,
)
from .hooks import Hooks, Middleware
from .job import (
    ALWAYS_COUNTED,
    STATUSES,
    JobDetail,
    JobInfo,
    JobPage,
    JobSummary,
    OnParentFailure,
    RetryResult,
    StatusCounts,
)
from .retention import Age, Retention, seconds
from .schedule import Schedule
from .task import Backoff, Handler, Task, name_of
from .workflow import Workflow

log = logging.getLogger("asyncjobq.queue")
# A task's or queue's name as a JSON string, in each row an enqueue hands the inserter: the
# few names an app uses, encoded once each. Exact strs only: a str subclass may hash as
# another name, or not at all.
_json_names = functools.lru_cache(maxsize=1024)(json.dumps)


def _json_name(name: str) -> str:
    return _json_names(name) if type(name) is str else json.dumps(name)


# What a Queue's DSN may point at (Queue(pooler=...); docs/guides/deploying.md).
POOLERS = ("auto", "transaction", "session", "none")



class Queue:
    """A job queue in one PostgreSQL schema. Open it (`async with queue:`) before use.

    Args:
        dsn: the PostgreSQL DSN; None takes $ASYNCJOBQ_DSN, else starts (or reuses) the
            embedded server (asyncjobq[embedded]) under ./.asyncjobq or $ASYNCJOBQ_HOME.
        schema: the schema holding the queue's tables; several queues may share a database.
        pool_min_size: connections the pool keeps open.
        pool_max_size: connections the pool may open (handlers' `queue.connection()` included;
            a worker also holds a few of its own: listen, heartbeat, fetch, complete).
        connect_timeout: seconds to wait for the server when opening, and in an enqueue
            while it is down (docs/guides/enqueueing.md).
        application_name: shown in pg_stat_activity; the worker's connections append a suffix.
        retention: how long done and cancelled jobs stay in history (a timedelta or seconds;
            None keeps them forever).
        queue_retention: retention per queue name, overriding `retention`.
        max_result_bytes: the largest handler return value stored as a job's result.
        pooler: what sits between this process and PostgreSQL. "auto" (the default) finds
            out as the queue opens; "transaction" when `dsn` points at a transaction-mode
            pooler such as PgBouncer (no prepared statements, session settings or LISTEN on
            it); "session" or "none" for a session pooler or PostgreSQL itself.
        listen_dsn: a direct connection to PostgreSQL for LISTEN when `dsn` goes through a
            transaction pooler; without it, workers and `wait` poll (docs/guides/deploying.md).

    Attributes:
        tasks: the registered tasks by name (`@queue.task()`).
        schedules: the periodic schedules by name (`periodic`, `@queue.task(cron=...)`).
        hooks: the hooks, observers and middleware registered on this queue
            (`asyncjobq.hooks.Hooks`); `hooks.timeout` is how long a hook may take.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "asyncjobq",
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        connect_timeout: float = 10.0,
        application_name: str = "asyncjobq",
        retention: Age = DEFAULT_RETENTION,
        queue_retention: Mapping[str, Age] | None = None,
        max_result_bytes: int = 1_000_000,
        pooler: str = "auto",
        listen_dsn: str | None = None,
    ) -> None:
        schema = validate_schema(schema)
        # At most 64 MiB: a flush carries its batch's results in one parameter (the worker
        # splits batches past 16 MiB of them, _worker/completer.py), jsonb stops at 256 MiB.
        if not int_between(max_result_bytes, 0, 64 * 2**20):
            raise ConfigurationError(f"max_result_bytes={max_result_bytes!r}: use a number of "
                                     "bytes from 0 to 64 MiB, e.g. 1_000_000 (a handler's "
                                     "return value over it dead-letters its job)")
        # The largest handler return value stored as a job's result, as JSON text.
        self.max_result_bytes = int(max_result_bytes)
        self._waiter: Waiter | None = None
        # How long done/cancelled jobs stay queryable in history; workers prune past it.
        self.retention = Retention.of(retention, queue_retention)
        if not is_positive(connect_timeout):
            raise ConfigurationError(f"connect_timeout={connect_timeout!r}: use a number of "
                                     "seconds above 0, e.g. 10")
        if pool_min_size < 0 or pool_max_size < max(1, pool_min_size):
            raise ConfigurationError(
                f"pool sizes min={pool_min_size} max={pool_max_size} are invalid: "
                "use 0 <= pool_min_size <= pool_max_size and pool_max_size >= 1"
            )
        self._db = Database(dsn, schema=schema, pool_min_size=pool_min_size,
                            pool_max_size=pool_max_size, connect_timeout=connect_timeout,
                            application_name=application_name)
        self.set_pooler(pooler, listen_dsn=listen_dsn)
        self._inserter: Inserter | None = None
        self._partitions: PartitionWriter | None = None  # batch inserts, while open
        self.tasks: dict[str, Task] = {}
        # Periodic schedules by name (queue.periodic, @queue.task(cron=...)).
        self.schedules: dict[str, Schedule] = {}
        self.hooks = Hooks()
        # Set by asyncjobq.testing.isolated for its block: an app's lifespan ending inside
        # the test (its close()) must not close the queue the test still uses.
        self._kept_open = False

    def __repr__(self) -> str:
        return f"<asyncjobq.Queue schema={self.schema!r} dsn={self._db.where()!r}>"

    @property
    def schema(self) -> str:
        """The schema holding the queue's tables."""
        return self._db.schema

    @property
    def database(self) -> Database:
        """The schema's database access (DSN, pool, named statements) that the worker's parts
        and the maintenance services are handed; for integrations and tests."""
        return self._db

    @property
    def sql(self) -> Statements:
        """Every statement asyncjobq runs on this schema, by name."""
        return self._db.sql

    @property
    def channel(self) -> str:
        """The NOTIFY channel the jobs table's insert trigger signals."""
        return self._db.channel

    @property
    def dsn(self) -> str:
        """The DSN in use, resolved on first use from the argument, else $ASYNCJOBQ_DSN,
        else the embedded server."""
        return self._db.dsn

    @property
    def application_name(self) -> str:
        """Shown in pg_stat_activity; the worker's own connections append -listen, -heartbeat,
        -fetch, -complete."""
        return self._db.application_name

    @application_name.setter
    def application_name(self, name: str) -> None:
        self._db.application_name = name

    def set_dsn(self, dsn: str | None) -> None:
        """Point a not-yet-opened queue at another database (the CLI's `--dsn` does this);
        a `listen_dsn` given before is forgotten (it reached the other database)."""
        self._db.set_dsn(dsn)

    def set_pooler(self, pooler: str | None, *, listen_dsn: str | None = None) -> None:
        """Say what a not-yet-opened queue's DSN points at, as `Queue(pooler=, listen_dsn=)`
        do (the worker command's `--pooler` and `--listen-dsn`); None keeps the setting."""
        if pooler is not None and pooler not in POOLERS:
            raise ConfigurationError(
                f"pooler={pooler!r}: use one of {', '.join(map(repr, POOLERS))} ('transaction' "
                "when the DSN points at PgBouncer in transaction mode)")
        self._db.set_pooler(pooler, None if listen_dsn is None else check_dsn(listen_dsn))

    @contextmanager
    def bound_to(self, dsn: str, schema: str) -> Iterator[Queue]:
        """Point this closed queue at another database and schema for the block, then back as
        it was: the app's module-level tasks keep enqueueing through the same object
        (asyncjobq.testing.isolated does this). Close the queue before the block ends; tasks,
        schedules, hooks and middleware registered in the block are forgotten after it."""
        before = self._db.rebind(check_dsn(dsn), validate_schema(schema))
        # What the block registers (tasks, schedules, hooks, middleware) goes with it: a test's
        # middleware must not run in the next test's jobs.
        tasks, schedules, hooks = dict(self.tasks), dict(self.schedules), self.hooks
        self.hooks = hooks.copy()
        try:
            yield self
        finally:
            self.tasks.clear()
            self.tasks.update(tasks)
            self.schedules.clear()
            self.schedules.update(schedules)
            self.hooks = hooks
            self._db.restore(before)

    # --- task registry ---------------------------------------------------------------------

    def task(
        self,
        name: str | None = None,
        *,
        queue: str = "default",
        max_attempts: int = 3,
        timeout: float | None = None,
        priority: int = 0,
        backoff: Backoff | None = None,
        cron: str | None = None,
        timezone: str = "UTC",
        concurrency_limit: int | None = None,
        key_limit: int | None = None,
        rate_limit: str | None = None,
    ) -> Callable[[Handler], Task]:
        """Register a handler: `@queue.task()` above `async def` (plain `def` runs in a thread).

        Limits (`concurrency_limit`, `key_limit`, `rate_limit`) take effect in the workers
        that register the task and serve its queue, when they (re)start; a limited task's jobs
        are enqueued into its queue only (docs/guides/flow-control.md).

        Args:
            name: the task's name, stored with each job; default "<module>.<qualname>".
            queue: the queue its jobs go to unless enqueue says otherwise.
            max_attempts: attempts before a failing job is dead-lettered (`failed`).
            timeout: seconds an attempt may run before it is cancelled and counted as failed;
                a `def` handler cannot be interrupted, so its job keeps its slot and lease
                until the body returns. None: no limit.
            priority: higher runs first among due jobs of a queue.
            backoff: seconds to wait before the next attempt, given the attempt that failed;
                default min(300, 2 ** attempt) plus up to 10 % jitter.
            cron: the task's one schedule (see `periodic`), named after the task and run
                with an empty payload; e.g. `"0 3 * * *"`.
            timezone: the IANA timezone `cron` is read in.
            concurrency_limit: at most this many of the task's jobs run at once across every
                worker of the fleet (docs/guides/flow-control.md). Enforced in the claim; a job
                held back stays queued and burns no attempt.
            key_limit: at most this many of the task's jobs with one `key` (enqueue(key=))
                run at once, and a key's jobs start in (priority, run_at, id) order; 1 runs
                each key's jobs one at a time. Jobs without a key are not limited by it.
            rate_limit: at most N starts per period across the fleet: "N/s", "N/m", "N/h".
        """
        check_queue_name(queue)
        check_max_attempts(max_attempts)
        check_int("priority", priority)
        check_timeout(timeout)
        # A bad expression or timezone fails here, at the decorator, before the handler exists.
        clock = cron_clock(cron, timezone_of(timezone)) if cron is not None else None
        check_flow_limit("concurrency_limit", concurrency_limit)
        check_flow_limit("key_limit", key_limit)
        if rate_limit is not None:
            parse_rate(rate_limit)
        if cron is None and timezone != "UTC":
            raise ConfigurationError(f"timezone={timezone!r} without cron=: the timezone is the "
                                     "one the task's cron expression is read in; pass cron=")

        def register(fn: Handler) -> Task:
            task_name = name or f"{fn.__module__}.{fn.__qualname__}"
            check_task_name(task_name)
            if task_name in self.tasks:
                raise ConfigurationError(
                    f"task {task_name!r} is registered twice: give one of them another name="
                )
            if clock is not None:
                self._check_schedule_name(task_name)
            t = Task(self, task_name, fn, queue, max_attempts, timeout, priority, backoff,
                     concurrency_limit, key_limit, rate_limit)
            self.tasks[task_name] = t
            if clock is not None:
                self.schedules[task_name] = Schedule(task_name, task_name, clock, cron, None,
                                                     timezone, "{}")
            return t

        return register

    # --- periodic jobs (_maintenance/periodic.py, scheduler.py) -----------------------------

    def periodic(
        self,
        task: str | Task,
        *,
        cron: str | None = None,
        every: float | timedelta | None = None,
        name: str | None = None,
        payload: dict[str, Any] | None = None,
        timezone: str = "UTC",
        queue: str | None = None,
        priority: int | None = None,
        max_attempts: int | None = None,
        catch_up: bool = False,
    ) -> Schedule:
        """Enqueue a job of `task` at every tick of a schedule, once per fleet.

        The leader's scheduler enqueues each tick exactly once however many workers run this
        app (a unique key on (name, tick) in the database), with `run_at` at the tick's time
        and `payload` as the job's payload. Every worker of a schema should register the same
        schedules: the leader's are the ones that run.

        Args:
            task: the task's name or Task; it must be registered (here or later) by the time a
                worker starts.
            cron: 5 fields (minute hour day month weekday), 6 with seconds first, or @hourly,
                @daily, @weekly, @monthly, @yearly; read in `timezone`. Needs the cron extra.
            every: an interval in seconds or a timedelta, at least 1 s; ticks fall on the
                multiples of it since 1970-01-01 UTC. Exactly one of `cron` and `every`.
            name: the schedule's name, unique on this queue; default the task's name.
            payload: the JSON object every tick's job carries.
            timezone: an IANA timezone name for `cron` (DST: docs/how-it-works/architecture.md);
                `every` takes only "UTC".
            queue, priority, max_attempts: for the jobs; default the task's.
            catch_up: after ticks were missed while no worker ran for longer than two leases,
                enqueue all of them (at most 100) instead of only the latest.
        """
        task_name = name_of(task)
        if (cron is None) == (every is None):
            raise ConfigurationError(
                f"periodic({task_name!r}): pass exactly one of cron= (e.g. '*/15 * * * *') "
                "and every= (e.g. timedelta(seconds=30))")
        zone = timezone_of(timezone)
        if every is not None and timezone != "UTC":
            # Interval ticks are instants (multiples of `every` since the epoch): a timezone
            # would change nothing, and a user who passes one expects wall-clock times.
            raise ConfigurationError(
                f"timezone={timezone!r} with every=: intervals tick at multiples of every since "
                "1970-01-01 UTC whatever the timezone; for wall-clock times use cron= (e.g. "
                "cron='0 0 * * *', timezone=...)")
        clock: Clock | None = cron_clock(cron, zone) if cron is not None else None
        seconds = every_seconds(every) if every is not None else None
        schedule_name = task_name if name is None else name
        check_name("schedule name", schedule_name, "nightly-report")
        body = encode_payload(payload)
        if queue is not None:
            check_queue_name(queue)
        if priority is not None:
            check_int("priority", priority)
        if max_attempts is not None:
            check_max_attempts(max_attempts)
        if not isinstance(catch_up, bool):
            raise ConfigurationError(f"catch_up={catch_up!r}: use True or False")
        self._check_schedule_name(schedule_name)
        if clock is None:
            assert seconds is not None
            clock = Every(seconds)
        schedule = Schedule(schedule_name, task_name, clock, cron, seconds, timezone, body,
                            queue, priority, max_attempts, catch_up)
        self.schedules[schedule_name] = schedule
        return schedule

    def _check_schedule_name(self, name: str) -> None:
        if name in self.schedules:
            raise ConfigurationError(
                f"schedule {name!r} is registered twice: pass name= to tell them apart")

    def check_schedules(self) -> list[Schedule]:
        """The schedules with their task's defaults filled in; raises ConfigurationError
        naming a schedule whose task is not registered. Workers call it when they start."""
        resolved = []
        for s in self.schedules.values():
            t = self.tasks.get(s.task)
            if t is None:
                known = ", ".join(sorted(self.tasks)) or "none"
                raise ConfigurationError(
                    f"schedule {s.name!r} enqueues task {s.task!r}, which is not registered: "
                    f"register it with @queue.task(name={s.task!r}) or fix the schedule's task "
                    f"(registered tasks: {known})")
            if s.queue is not None and (why := t.refuses(s.queue)) is not None:
                raise ConfigurationError(
                    f"schedule {s.name!r}: {why}: leave out the schedule's queue=, or declare "
                    f"the task on {s.queue!r} with @queue.task(queue={s.queue!r}, ...)")
            resolved.append(replace(
                s, queue=s.queue if s.queue is not None else t.queue,
                priority=s.priority if s.priority is not None else t.priority,
                max_attempts=s.max_attempts if s.max_attempts is not None else t.max_attempts))
        return resolved

    async def list_schedules(self) -> list[dict[str, Any]]:
        """Every schedule with its last enqueued tick and its next one: dicts of name, task,
        expression, timezone, payload, queue, catch_up, last_tick and next_tick (UTC
        datetimes or None)."""
        schedules = self.check_schedules()
        names = [s.name for s in schedules]
        rows: dict[str, tuple[datetime | None, datetime | None]] = {}
        now = datetime.now(UTC)
        if names:
            async with self._conn(None) as c:
                cur = await c.execute(self.sql.periodic_schedule_ticks, {"names": names})
                for name, last, latest, server_now in await cur.fetchall():
                    rows[name] = (last, latest)
                    now = server_now
        out = []
        for s in schedules:
            last, latest = rows.get(s.name, (None, None))
            start = now if latest is None else max(latest, now)
            out.append({"name": s.name, "task": s.task, "expression": s.expression,
                        "timezone": s.timezone, "payload": json.loads(s.payload),
                        "queue": s.queue, "catch_up": s.catch_up, "last_tick": last,
                        "next_tick": s.next_after(start)})
        return out

    async def last_ticks(self) -> dict[str, datetime | None]:
        """{schedule name: last tick enqueued} for every schedule the database has recorded,
        whichever app registered it (None: started, no tick yet)."""
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.periodic_ticks_latest)
            return {str(name): tick for name, tick in await cur.fetchall()}

    # --- hooks and middleware (hooks.py) ----------------------------------------------------

    def add_hook(self, hook: object) -> None:
        """Register an object with any of the hook methods (on_enqueued, on_claimed,
        on_started, on_finished, on_reaped, on_leader_changed), each an `async def` called
        with keyword arguments; an exception in a hook is logged and never affects a job."""
        self.hooks.add_hook(hook)

    def add_middleware(self, middleware: Middleware) -> None:
        """Wrap every handler call: `async def mw(job, call_next): return await
        call_next(job)`. Middleware added first is outermost."""
        self.hooks.add_middleware(middleware)

    # --- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the connection pool (a no-op when open); `async with queue:` calls it.

        Raises `DatabaseUnavailableError` when PostgreSQL cannot be reached within
        `connect_timeout`. Opening does not install the schema: `install` does.
        """
        if self._db.is_open:
            return
        await self._db.open()
        # Half the pool at most for coalesced enqueues: handlers and admin calls keep the rest.
        self._inserter = Inserter(self._write_rows,
                                  max_in_flight=max(1, self._db.pool_sizes[1] // 2))
        self._partitions = PartitionWriter(self._db)

    async def close(self) -> None:
        """Wait for enqueues in flight and for `on_enqueued` hooks (up to `hooks.timeout`),
        then close the pool; `async with queue:` calls it on the way out."""
        if self._kept_open:
            return  # asyncjobq.testing.isolated closes it at the end of its block
        if self._inserter is not None:
            await self._inserter.drain()
        self._inserter = None
        self._partitions = None
        await self._close_waiter()
        await self.hooks.settle(timeout=self.hooks.timeout)  # on_enqueued calls still running
        await self._db.close()
        await self._close_waiter()  # one a wait made while the hooks settled

    async def _close_waiter(self) -> None:
        """End the pending waits (QueueClosedError) and their listening connection."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # made on another, now closed, loop
                await waiter.close()

    async def __aenter__(self) -> Queue:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def pool(self) -> AsyncConnectionPool[Conn]:
        """The psycopg_pool pool of the open queue; `QueueClosedError` when it is closed.
        Prefer `connection()`, which checks each connection before handing it out."""
        return self._db.pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A pooled autocommit connection (for handlers and admin work)."""
        async with self._db.connection() as conn:
            yield conn

    @asynccontextmanager
    async def _conn(self, conn: Conn | None) -> AsyncIterator[Conn]:
        with self._db.translate_errors():
            if conn is not None:
                yield conn
            else:
                async with self._db.connection() as c:
                    yield c

    def translate_errors(self) -> AbstractContextManager[None]:
        """Turn 'schema or table missing' into an error that says to run install."""
        return self._db.translate_errors()

    # --- install ---------------------------------------------------------------------------

    async def install(self) -> list[int]:
        """Apply the sql/ migrations not yet applied; returns their versions. Idempotent."""
        async with self._db.connection() as conn:  # checked, as every checkout (database.py)
            try:
                return await migrations.apply(conn, self.schema)
            except psycopg.errors.InsufficientPrivilege as e:
                raise AsyncJobQError(
                    f"this role may not install schema {self.schema} ({reason(e)}): run install "
                    "as the schema's owner, a role with CREATE on the database "
                    "(docs/guides/roles.md)"
                ) from None

    # --- enqueue ---------------------------------------------------------------------------

    async def enqueue(
        self,
        task: str | Task,
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        dedup_key: str | None = None,
        key: str | None = None,
        conn: Conn | None = None,
        after: Sequence[int] | None = None,
        on_parent_failure: OnParentFailure = "cancel",
    ) -> int:
        """Add one job; returns its id (the existing job's id for a live duplicate dedup_key).

        With `conn=`, the job is written in that connection's transaction: it exists, and wakes
        workers, only if that transaction commits. `key` (e.g. "account:42") puts the job in
        that key's line when its task has a key_limit. `after=[ids]`: the job waits until
        those jobs are done (a workflow of one job, see `workflow()`; `on_parent_failure`
        says what it does when one of them fails: "cancel" or "run").
        """
        if after:
            if dedup_key is not None:
                raise ConfigurationError("dedup_key with after=: a job that waits for parents "
                                         "takes no dedup_key; leave one of them out")
            wf = self.workflow()
            wf.add(task, payload, after=after, on_parent_failure=on_parent_failure,
                   queue=queue, priority=priority, run_at=run_at, delay=delay,
                   max_attempts=max_attempts, key=key)
            return (await wf.enqueue(conn=conn))[0]
        check_conn(conn)
        name, q, prio, attempts = self._defaults(task, queue, priority, max_attempts)
        body = encode_payload(payload)
        when, secs = check_timing(run_at, delay)
        check_dedup_key(dedup_key)
        check_key("key", key)
        send = tracing.producer(name, q)
        if send is None:
            return await self._enqueue(name, body, q, prio, when, secs, attempts, dedup_key,
                                       conn, None, key)
        with send:
            job_id = await self._enqueue(name, body, q, prio, when, secs, attempts, dedup_key,
                                         conn, send.context, key)
            send.written([job_id])
            return job_id

    async def _enqueue(self, name: str, body: str, q: str, prio: int, when: datetime | None,
                       secs: float, attempts: int, dedup_key: str | None, conn: Conn | None,
                       trace: str | None, key: str | None = None) -> int:
        if conn is None and dedup_key is None and key is None:
            job = (f"[{_json_name(name)},{body},{_json_name(q)},{prio:d},"
                   f"{'null' if when is None else json.dumps(when.astimezone(UTC).isoformat())},"
                   f"{'0.0' if secs == 0 else json.dumps(secs)},"
                   f"{attempts:d}"
                   f"{',' + trace if trace is not None else ''}]")
            job_id = await self._open_inserter().insert(job, (q, prio))
            if self.hooks.on_enqueued:
                self.hooks.spawn("on_enqueued", job_ids=[job_id], task=name, queue=q)
            return job_id
        params = {"task": name, "payload": body, "queue": q, "priority": prio, "run_at": when,
                  "delay": secs, "max_attempts": attempts, "dedup_key": dedup_key,
                  "trace": trace, "key": key}
        insert = (self.sql.job_insert_keyed if key is not None
                  else self.sql.job_insert if trace is None else self.sql.job_insert_traced)
        advice = _RESEND_DEDUP if dedup_key is not None else _USE_DEDUP
        for _ in range(10):
            # With a dedup_key, sending the INSERT again after a lost reply is safe: it
            # returns the job the first one wrote, if it did.
            rows = await write(self._db, conn, insert, params, what="the job",
                               resend=dedup_key is not None, advice=advice)
            if rows:
                job_id = int(rows[0][0])
                if rows[0][1] and self.hooks.on_enqueued:
                    self.hooks.spawn("on_enqueued", job_ids=[job_id], task=name, queue=q)
                return job_id
            # The duplicate committed after our snapshot, or finished meanwhile: look again.
        raise AsyncJobQError(f"enqueue with dedup_key={dedup_key!r} kept racing with other "
                             "writers of that key: try again")

    def workflow(self) -> Workflow:
        """A new workflow: jobs that wait for other jobs, enqueued together
        (`asyncjobq.Workflow`, docs/guides/workflows.md)."""
        return Workflow(self)

    def _open_inserter(self) -> Inserter:
        if self._inserter is None:
            raise QueueClosedError(NOT_OPEN)
        return self._inserter

    async def _write_rows(self, rows: list[str], one_lane: bool) -> list[int]:
        # Each caller of the batch enqueued one job: the error speaks to each of them.
        # A traced row ends with its trace context's object (`}]`), an untraced one with
        # max_attempts (a digit): only a batch with a traced row writes the column.
        traced = any(r[-2] == "}" for r in rows)
        writer = self._partitions
        if writer is None:
            raise QueueClosedError(NOT_OPEN)
        result = await writer.write(_ROWS_TRACED if traced else _ROWS,
                                    {"rows": "[" + ",".join(rows) + "]"}, what="the job",
                                    advice=_USE_DEDUP, one_lane=one_lane)
        return [int(r[0]) for r in result]

    async def enqueue_many(
        self,
        task: str | Task,
        payloads: Sequence[dict[str, Any]],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        keys: Sequence[str | None] | None = None,
        conn: Conn | None = None,
    ) -> list[int]:
        """Add many jobs of one task in a single statement; returns their ids in order.

        `keys`, one per payload (None: no key), as `enqueue(key=)` takes them.
        """
        check_conn(conn)
        name, q, prio, attempts = self._defaults(task, queue, priority, max_attempts)
        if isinstance(payloads, dict | str | bytes):
            raise InvalidPayloadError(
                "enqueue_many takes a list of payload dicts: wrap a single payload in a list, "
                "or call enqueue()"
            )
        array = encode_payload_array(payloads)
        key_array = encode_keys(keys, len(payloads))
        if array == "[]":
            return []
        when, secs = check_timing(run_at, delay)
        n = len(payloads)
        send = tracing.producer(name, q, n)
        if send is None:
            ids = await self._enqueue_many(name, q, prio, when, secs, attempts, array, n, conn,
                                           None, key_array)
        else:
            with send:
                ids = await self._enqueue_many(name, q, prio, when, secs, attempts, array, n,
                                               conn, send.context, key_array)
        if self.hooks.on_enqueued:
            self.hooks.spawn("on_enqueued", job_ids=ids, task=name, queue=q)
        return ids

    async def _enqueue_many(self, name: str, q: str, prio: int, when: datetime | None,
                            secs: float, attempts: int, array: str, n: int,
                            conn: Conn | None, trace: str | None,
                            key_array: str | None = None) -> list[int]:
        # One trace context for the batch: every job's attempts are children of its span.
        which = "keyed" if key_array is not None else "plain" if trace is None else "traced"
        params = {"task": name, "queue": q, "priority": prio, "run_at": when, "delay": secs,
                  "max_attempts": attempts, "trace": trace, "payloads": array,
                  "keys": key_array}
        what = "the job" if n == 1 else f"the {n} jobs (all or none of them)"
        if conn is None and self._partitions is not None:
            rows = await self._partitions.write(_MANY[which], params, what=what,
                                                advice=_MANY_UNSURE, one_lane=True)
        else:
            rows = await write(self._db, conn, _MANY[which](self.sql), params, what=what,
                               resend=False, advice=_MANY_UNSURE)
        return [int(r[0]) for r in rows]

    def _defaults(
        self, task: str | Task, queue: str | None, priority: int | None, max_attempts: int | None
    ) -> tuple[str, str, int, int]:
        name = name_of(task)
        t = task if isinstance(task, Task) else self.tasks.get(name)
        q = queue if queue is not None else (t.queue if t else "default")
        prio = priority if priority is not None else (t.priority if t else 0)
        attempts = max_attempts if max_attempts is not None else (t.max_attempts if t else 3)
        check_queue_name(q)
        if t is not None and (why := t.refuses(q)) is not None:
            raise ConfigurationError(
                f"{why}: enqueue it there (leave out queue=), or declare the task on "
                f"{q!r} with @queue.task(queue={q!r}, ...)")
        check_int("priority", prio)
        check_max_attempts(attempts)
        return name, q, prio, attempts

    # --- admin -----------------------------------------------------------------------------

    async def get(self, job_id: int) -> JobInfo | None:
        """The job's current row, from the live table or the history; None if unknown."""
        check_int("job_id", job_id, bits=64)
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.job_get_by_id, {"id": job_id})
            row = await cur.fetchone()
            if row is None:
                return None
            return await self._with_family(c, JobInfo(*row))

    async def stats(self) -> dict[str, dict[str, int]]:
        """{queue: {status: count}} for every queue seen: queued, running, done, failed and
        cancelled always, waiting (workflows) when there are some; a status not there reads
        as 0 (`stats()[queue]["waiting"]`)."""
        out: dict[str, dict[str, int]] = {}
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.job_count_by_queue_status)
            for queue, status, n in await cur.fetchall():
                counts = out.setdefault(queue, StatusCounts.fromkeys(ALWAYS_COUNTED, 0))
                counts[status] += int(n)
        return out

    async def retry_failed(
        self, queue: str | None = None, task: str | None = None, error_like: str | None = None,
        *, max_id: int | None = None, limit: int | None = None
    ) -> RetryResult:
        """Requeue dead-lettered (failed) jobs, attempts reset; returns how many (an int), with
        `.skipped`: the matching ones left failed because their dedup_key is taken (by a
        queued or running job, or by the newest failed job of that key, requeued instead).
        `max_id`: only jobs with an id up to it (those a preview counted); `limit`: at most
        that many of the matching jobs, the newest (a preview's count)."""
        if max_id is not None:
            check_int("max_id", max_id, bits=64)
        check_limit(limit)
        for what, value in (("queue", queue), ("task", task), ("error_like", error_like)):
            check_text_filter(what, value)
        params = {"queue": queue, "task": task, "error_like": error_like,
                  "max_id": max_id, "limit": limit, "channel": self.channel}
        row = await self._requeue_failed(
            self.sql.job_retry_failed_at_most(capped=limit is not None), params,
            "retry_failed kept racing with enqueues of the same dedup_keys (10 tries): call "
            "retry_failed() again once those enqueues settle")
        return RetryResult(int(row[0]), int(row[1])) if row else RetryResult()

    async def _requeue_failed(self, statement: Statement, params: dict[str, Any],
                              raced: str) -> tuple[Any, ...] | None:
        """Run a statement that requeues failed jobs; its row, or None. A UniqueViolation
        means a job with one of their dedup_keys was enqueued after the statement's snapshot:
        nothing was requeued, and the next snapshot sees that job and skips its key. After 10
        such races, RetryRaceError(raced)."""
        for _ in range(10):
            try:
                async with self._conn(None) as c:
                    cur = await c.execute(statement, params)
                    return await cur.fetchone()
            except psycopg.errors.UniqueViolation:
                continue
        raise RetryRaceError(raced)

    async def leader(self) -> dict[str, Any] | None:
        """The worker leading this schema's maintenance (leader.py): {"worker", "since",
        "expires_at"}, or None while no worker leads."""
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.leader_get)
            row = await cur.fetchone()
        if row is None:
            return None
        return {"worker": row[0], "since": row[1], "expires_at": row[2]}

    async def health(self, lease: float = 30.0) -> dict[str, dict[str, float | int | None]]:
        """Per queue: age in seconds of the oldest due queued job, running jobs not heartbeated
        for `lease` seconds, and jobs finished in the last minute."""
        out: dict[str, dict[str, float | int | None]] = {}
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.queue_health, (lease,))
            for queue, oldest, stale, recent in await cur.fetchall():
                out[queue] = {
                    "oldest_queued_age_s": None if oldest is None else round(float(oldest), 3),
                    "stale_running": int(stale),
                    "done_last_minute": int(recent),
                }
        return out

    async def prune(self, older_than: float | timedelta | None = None, *,
                    queue: str | None = None, failed: bool = False) -> dict[str, int]:
        """Delete finished jobs from history now; returns {queue: rows deleted}.

        Without arguments this applies the queue's retention, as the workers do every minute.
        `older_than` overrides it (for `queue` only, when given). `failed=True` also deletes
        dead-lettered jobs that failed more than `older_than` ago (that needs `older_than`).
        """
        if queue is not None:
            check_queue_name(queue)
        age = seconds("older_than", older_than)
        if failed and age is None:
            raise ConfigurationError(
                "deleting failed jobs needs an age: pass older_than= (e.g. timedelta(days=7))")
        if age is None:
            policy = self.retention
            if queue is not None:
                own = dict(policy.per_queue).get(queue, policy.default)
                policy = Retention(None, ((queue, own),))
        elif queue is None:
            policy = Retention(age)
        else:
            policy = Retention(None, ((queue, age),))
        deleted = await prune_history(self._db, policy, wait=True)
        if failed and age is not None:
            for q, n in (await prune_failed(self._db, age, only_queue=queue)).items():
                deleted[q] = deleted.get(q, 0) + n
        return deleted

    async def pause(self, queue: str) -> bool:
        """Stop every worker from claiming `queue`'s jobs until resume(): running jobs finish,
        jobs enqueued meanwhile wait. Returns False when it was paused already.

        Claims already under way when the pause committed may not see it: pause() waits (up
        to PAUSE_SETTLE seconds, then logs a warning) until they have committed, so no job of
        the queue is claimed after it returns. Cancelled while waiting, the pause stands.
        Workers of a version before schema 6 do not know pauses: upgrade them all first."""
        check_queue_name(queue)
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.queue_pause, {"queue": queue})
            row = await cur.fetchone()
            cur = await c.execute(self.sql.paused_queues_lockers)
            found = await cur.fetchone()
            vxids = list(found[0]) if found else []
            deadline = time.monotonic() + PAUSE_SETTLE
            while vxids:
                cur = await c.execute(self.sql.paused_queues_lockers_left, {"vxids": vxids})
                left = await cur.fetchone()
                if not left or not left[0]:
                    break
                if time.monotonic() > deadline:
                    log.warning("pause(%r): %d claim(s) that began before the pause were still "
                                "running after %g s; jobs they claim may start after it",
                                queue, left[0], PAUSE_SETTLE)
                    break
                await asyncio.sleep(0.002)
        return bool(row and row[1])

    async def resume(self, queue: str) -> bool:
        """Let workers claim `queue`'s jobs again (they are woken at once); returns False when
        it was not paused."""
        check_queue_name(queue)
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.queue_resume,
                                  {"queue": queue, "channel": self.channel})
            row = await cur.fetchone()
        return bool(row and row[0])

    async def limits(self) -> dict[str, dict[str, Any]]:
        """The limits of this Queue's limited tasks, as its code declares them, with their use
        now: {task: {"queue", "concurrency_limit", "key_limit", "rate_limit" (None when not
        set), "running", "keys_running", "started_in_period"}}."""
        limited = sorted((t for t in self.tasks.values() if t.limits), key=lambda t: t.name)
        if not limited:
            return {}
        periods = [parse_rate(t.rate_limit)[1] if t.rate_limit else 0.0 for t in limited]
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.flow_usage,
                                  {"tasks": [t.name for t in limited], "periods": periods})
            usage = {r[0]: r[1:] for r in await cur.fetchall()}
        return {t.name: {"queue": t.queue, "concurrency_limit": t.concurrency_limit,
                         "key_limit": t.key_limit, "rate_limit": t.rate_limit,
                         "running": int(usage[t.name][0]),
                         "keys_running": int(usage[t.name][1]),
                         "started_in_period": int(usage[t.name][2])}
                for t in limited}

    async def paused(self) -> dict[str, datetime]:
        """{queue: paused since} of the paused queues."""
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.queue_paused_list)
            return {str(q): at for q, at in await cur.fetchall()}

    async def cancel(self, job_id: int) -> bool:
        """Cancel a job. A queued or waiting one is cancelled now, and the jobs that wait for
        it as their `on_parent_failure` says; a running one is asked to stop: its worker
        hears of it within a second (a notification; its heartbeat's reply as the fallback),
        cancels the handler (an `async` one gets `asyncio.CancelledError`, a sync one sees
        `job.cancel_requested`) and writes `cancelled`; a handler that returned first keeps
        its outcome. A running job whose worker died is cancelled when the reaper takes it.
        No retry follows a cancel. True when the job was waiting, queued or running; False
        when it is finished (done, failed, cancelled) or unknown."""
        check_int("job_id", job_id, bits=64)
        params = {"id": job_id, "done": self._db.done_channel,
                  "cancel": self._db.cancel_channel}
        for _ in range(10):
            async with self._conn(None) as c:
                cur = await c.execute(self.sql.job_cancel, params)
                if [r for r in await cur.fetchall() if r[0] is not None]:
                    return True
                # Neither: finished, unknown, or claimed while the statement looked (its
                # snapshot saw it queued, its DELETE found it running): look again.
                cur = await c.execute(self.sql.job_get_by_id, {"id": job_id})
                row = await cur.fetchone()
            if row is None or JobInfo(*row).is_final:
                return False
        return False

    async def wait(self, job_id: int, *, timeout: float | None = None) -> JobInfo:
        """Wait until the job is final (done, failed, i.e. dead-lettered, or cancelled) and
        return it; its `result` is what the handler returned. An attempt that will be retried
        is not final. Woken by a notification when the job finishes; however many waits, a
        process listens on one connection of its own. A lost notification or a dropped
        connection delays a wait by a few seconds at most (a periodic re-read), never forever.

        Raises `TimeoutError` when `timeout` seconds pass first, `JobNotFoundError` for an id
        that does not exist (never enqueued, or pruned from history)."""
        check_int("job_id", job_id, bits=64)
        if timeout is not None and (not is_number(timeout) or timeout < 0):
            raise ConfigurationError(f"timeout={timeout!r}: use seconds >= 0, or None to wait "
                                     "as long as it takes")
        if not self._db.is_open:
            raise QueueClosedError("Queue.wait() on a closed queue: open it first "
                                   "(`async with queue:` or `await queue.open()`)")
        if timeout == 0:  # a look, not a wait
            info = await self.get(job_id)
            if info is None:
                raise JobNotFoundError(job_id)
            if info.is_final:
                return info
            raise TimeoutError(f"job {job_id} is {info.status}, not final")
        loop = asyncio.get_running_loop()
        if self._waiter is None or self._waiter.loop is not loop:
            self._waiter = Waiter(self._db)
        async with asyncio.timeout(timeout):
            return await self._waiter.wait(job_id)

    async def result(self, job_id: int, *, timeout: float | None = None) -> Any:
        """The job's result once it is done (`wait`, then its `result`). Raises
        `JobFailedError` when it was dead-lettered (`.error`: its last error),
        `JobCancelledError` when it was cancelled, and as `wait` does."""
        info = await self.wait(job_id, timeout=timeout)
        if info.status == "failed":
            raise JobFailedError(info)
        if info.status == "cancelled":
            raise JobCancelledError(info)
        return info.result

    # --- browsing (the dashboard's reads and actions; _db/sql/browse.py) -------------------

    async def list_jobs(self, *, queue: str | None = None, status: str | None = None,
                        task: str | None = None, before: int | None = None,
                        limit: int = 50) -> JobPage:
        """A page of jobs, newest first, live and finished: those with an id below `before`
        (the previous page's `next_before`; None: the newest), filtered by queue, status and
        task when given. Pages cost the same at any history size (0008_browse_indexes.sql)."""
        params = _browse_filters(queue, status, task)
        if before is not None:
            check_int("before", before, bits=64)
        if not int_between(limit, 1, 1000):
            raise ConfigurationError(f"limit={limit!r}: use an integer from 1 to 1000")
        params.update(before=2**63 - 1 if before is None else before, limit=limit + 1)
        statement = self.sql.job_page(queue=queue is not None, task=task is not None,
                                      statuses=params["statuses"])
        async with self._conn(None) as c:
            cur = await c.execute(statement, params)
            rows = await cur.fetchall()
        jobs = [JobSummary(*row) for row in rows[:limit]]
        return JobPage(jobs, jobs[-1].id if len(rows) > limit else None)

    async def count_jobs(self, *, queue: str | None = None, status: str | None = None,
                         task: str | None = None, max_id: int | None = None) -> int:
        """How many jobs match the filters (what a bulk retry or cancel would look at). Exact;
        history is read from its per-queue counts unless a task is given. `max_id`: only the
        jobs with an id up to it; it needs a status of the live table (queued, running or
        failed), as history is counted per queue, not per id."""
        params = _browse_filters(queue, status, task)
        if max_id is not None:
            check_int("max_id", max_id, bits=64)
            if status not in ("waiting", "queued", "running", "failed"):
                raise ConfigurationError(f"max_id with status={status!r}: pass status "
                                         "waiting, queued, running or failed (history is "
                                         "counted per queue, not per id)")
            params["max_id"] = max_id
        statement = self.sql.job_count(queue=queue is not None, task=task is not None,
                                       max_id=max_id is not None)
        async with self._conn(None) as c:
            cur = await c.execute(statement, params)
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def get_detail(self, job_id: int) -> JobDetail | None:
        """The job in full (payload, last error, timestamps, worker); None if unknown."""
        check_int("job_id", job_id, bits=64)
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.job_detail_by_id, {"id": job_id})
            row = await cur.fetchone()
            if row is None:
                return None
            detail = JobDetail(**dict(zip(_DETAIL_NAMES, row, strict=True)))
            return await self._with_family(c, detail)

    async def _with_family(self, c: Conn, info: _Info) -> _Info:
        # Its parents and children (workflows), read after the row: a job enqueued with
        # parents is written with its edges in one transaction.
        try:
            cur = await c.execute(self.sql.job_family, {"id": info.id})
            family = await cur.fetchall()
        except psycopg.errors.InsufficientPrivilege:
            # A role granted what `get` read before workflows (docs/guides/roles.md): the
            # job without its family, not an error.
            return info
        if not family:
            return info
        return replace(info, parents=tuple(int(i) for p, i in family if p),
                       children=tuple(int(i) for p, i in family if not p))

    async def retry(self, job_id: int) -> bool:
        """Requeue one failed (dead-lettered) job, attempts reset; False when it is not failed,
        or when another job holds its dedup_key (queued or running): retry it once that one
        has finished."""
        check_int("job_id", job_id, bits=64)
        row = await self._requeue_failed(
            self.sql.job_retry_one, {"id": job_id, "channel": self.channel},
            f"retry({job_id}) kept racing with enqueues of its dedup_key (10 tries): call "
            "retry() again once those enqueues settle, or give the job's producers a moment")
        return row is not None

    async def cancel_queued(self, *, queue: str | None = None, task: str | None = None,
                            max_id: int | None = None, limit: int | None = None) -> int:
        """Cancel every queued job of `queue` and/or `task` (both None: every queued job);
        returns how many. Running jobs are left to finish. `max_id`: only jobs with an id up
        to it (those a preview counted, not ones enqueued since); `limit`: at most that many,
        the newest (a preview's count)."""
        params = _browse_filters(queue, None, task)
        if max_id is not None:
            check_int("max_id", max_id, bits=64)
            params["max_id"] = max_id
        check_limit(limit)
        params["limit"] = limit
        params["done"] = self._db.done_channel
        statement = self.sql.job_cancel_queued(queue=queue is not None, task=task is not None,
                                               max_id=max_id is not None,
                                               capped=limit is not None)
        async with self._conn(None) as c:
            cur = await c.execute(statement, params)
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def throughput(self, minutes: int = 60) -> list[tuple[datetime, str, str, int]]:
        """Jobs finished per minute over the last `minutes` (1 to 1440): (minute, queue,
        status, count) rows, oldest first, for the minutes that had any; status is done,
        cancelled or failed. Reads the history of that span (its BRIN index)."""
        if not int_between(minutes, 1, 1440):
            raise ConfigurationError(f"minutes={minutes!r}: use an integer from 1 to 1440")
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.throughput_per_minute, {"m": minutes})
            return [(at, str(q), str(s), int(n)) for at, q, s, n in await cur.fetchall()]

    async def workers_seen(self, within: float = 300.0) -> list[dict[str, Any]]:
        """Workers seen lately, most recent first: {"worker", "seen_at", "running"} for those
        holding jobs now, those that finished one in the last `within` seconds, and the
        leader. An idle worker that is not the leader is not seen (there is no table of
        workers)."""
        if not is_positive(within):
            raise ConfigurationError(f"within={within!r}: use a number of seconds above 0")
        async with self._conn(None) as c:
            cur = await c.execute(self.sql.workers_seen, {"secs": float(within)})
            return [{"worker": str(w), "seen_at": at, "running": int(n)}
                    for w, at, n in await cur.fetchall()]


# Seconds pause() waits at most for claims that started before it committed (Queue.pause).
PAUSE_SETTLE = 5.0

# The batch inserts, picked from the Statements of jobs or of one partition (PartitionWriter).
_ROWS: Callable[[Statements], Statement] = attrgetter("job_insert_rows")
_ROWS_TRACED: Callable[[Statements], Statement] = attrgetter("job_insert_rows_traced")
_MANY: dict[str, Callable[[Statements], Statement]] = {
    "plain": attrgetter("job_insert_many"),
    "traced": attrgetter("job_insert_many_traced"),
    "keyed": attrgetter("job_insert_many_keyed"),
}

# What to do when an enqueue's job may or may not have been written (inserter.write).
_USE_DEDUP = ("enqueueing it again may create it twice: pass a dedup_key to make that safe "
              "(enqueue then sends it again by itself)")
_RESEND_DEDUP = ("enqueue it again with the same dedup_key: that returns the existing job's id "
                 "while it is queued or running (one that already ran is not matched: a new "
                 "job is created)")
_MANY_UNSURE = ("enqueueing them again may create them twice: look for them first, or enqueue "
                "each with a dedup_key")


_Info = TypeVar("_Info", bound=JobInfo)
# JobDetail's fields in the order job_detail_by_id selects them: JobInfo's parents and children
# are read apart (Queue._with_family).
_DETAIL_NAMES = [f.name for f in fields(JobDetail) if f.name not in ("parents", "children")]


def _browse_filters(queue: object, status: object, task: object) -> dict[str, Any]:
    """The bound parameters of a browse statement; ConfigurationError naming a bad filter."""
    if queue is not None:
        check_queue_name(queue)
    if task is not None:
        check_task_name(task)
    if status is not None and status not in STATUSES:
        raise ConfigurationError(f"status={status!r}: use one of {', '.join(STATUSES)}, "
                                 "or None for all")
    return {"queue": queue, "task": task,
            "statuses": list(STATUSES) if status is None else [status]}
