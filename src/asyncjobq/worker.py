"""The worker: one event loop holding a LISTEN connection, a pool, and the parts below
(docs/how-it-works/architecture.md).

    listener -> fetcher -> bounded handler tasks -> completer
                heartbeat (extends leases, its own thread)
                services (services.py): the leader elector on every worker; on the leader only,
                the reaper (requeues stale jobs), the pruner (history past retention), the
                hot-table vacuum (between autovacuum's visits) and, when the queue has
                schedules, the periodic scheduler
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence

import anyio
import psycopg
from psycopg_pool import PoolTimeout

from . import job as job_module
from . import metrics, tracing
from ._checks import check_name, check_positive, check_queue_name, int_between, is_number
from ._db import migrations
from ._db.database import cache_long_statements
from ._maintenance.leader import Elector
from ._maintenance.pruner import Pruner
from ._maintenance.reaper import Reaper
from ._maintenance.rotation import Rotation
from ._maintenance.sampler import DepthSampler
from ._maintenance.scheduler import Scheduler
from ._maintenance.services import Service, ServiceRunner
from ._maintenance.vacuum import HotTableVacuum
from ._worker.completer import Completer
from ._worker.control import Control
from ._worker.executor import RunningJob, execute, finished
from ._worker.fetcher import Fetcher
from ._worker.heartbeat import Heartbeat
from ._worker.listener import Listener
from ._worker.misplaced import Mover
from ._worker.outcome import Outcome
from ._worker.progress import ProgressWriter
from ._worker.running import Running
from ._worker.threads import ThreadRunner
from .errors import ConfigurationError, reason
from .job import Job, current_job
from .queue import Queue

log = logging.getLogger("asyncjobq.worker")


def default_batch_size(concurrency: int) -> int:
    """10 at the default concurrency 20, or half the slots, up to 100.

    Claims are sized to free slots; a fixed 10 caps a worker with hundreds of slots at about
    10 jobs per claim round trip (7,000 jobs/s for 5 ms jobs at concurrency 200, where half
    the slots per claim reach 12,000+; benchmarks/results/RESULTS.md section 3).
    """
    return max(10, min(100, concurrency // 2))


class Worker:
    """Runs the handlers registered on `queue` for jobs of `queues`, until stop().

    Args:
        queue: the Queue whose tasks this worker runs (and whose database it claims from).
        queues: names of the queues to claim from (a string for one).
        concurrency: handlers running at once; sync (`def`) handlers count too, each in a
            thread of its own, until their body returns even past a timeout.
        batch_size: most jobs claimed per statement (claims are sized to free slots);
            concurrency // 2, at least 10 and at most 100.
        lease: seconds a running job may go without a heartbeat before the leader's reaper
            takes it back; also how long the leader's row lasts. Use one value per schema.
        poll_interval: seconds between polls when idle; notifications wake workers sooner.
        shutdown_timeout: seconds running handlers get to finish after stop() or SIGTERM
            before they are cancelled and their jobs put back to queued.
        name: prefix of this worker's id (`locked_by`); default "<host>-<pid>".
        listen: wake on LISTEN/NOTIFY (True) or poll only (False).
        flush_interval: seconds an outcome may wait to be written with others.
        reap_interval: seconds between the leader's reaper turns; default min(5, lease / 2).
        prune_interval: seconds between the leader's history pruning turns.
        vacuum_interval: seconds between the leader's checks of the hot table's dead rows;
            None leaves the table to autovacuum.
        metrics_port: serve Prometheus metrics (asyncjobq.metrics) at
            http://<host>:<port>/metrics; needs the `prometheus` extra. 0 picks a free port
            (see `metrics_server.port`).
        metrics_host: the address /metrics listens on: every interface by default, since
            Prometheus scrapes from another host ("127.0.0.1" keeps it to this one). The page
            holds counts by queue, task and outcome, never payloads or errors.
        metrics_interval: seconds between the leader's samples of the queue depth
            (asyncjobq_queue_jobs), when metrics are collected; at least 0.1.
    """

    def __init__(
        self,
        queue: Queue,
        queues: Sequence[str] = ("default",),
        concurrency: int = 20,
        batch_size: int | None = None,
        lease: float = 30.0,
        poll_interval: float = 1.0,
        shutdown_timeout: float = 30.0,
        name: str | None = None,
        *,
        listen: bool = True,
        flush_interval: float = 0.005,
        reap_interval: float | None = None,
        prune_interval: float = 60.0,
        vacuum_interval: float | None = 1.0,
        metrics_port: int | None = None,
        metrics_interval: float = 5.0,
        metrics_host: str = "0.0.0.0",
    ) -> None:
        if not isinstance(queue, Queue):
            raise ConfigurationError(
                f"Worker needs an asyncjobq.Queue, got {type(queue).__name__}")
        if isinstance(queues, str):
            queues = (queues,)
        if not queues:
            raise ConfigurationError(
                "queues is empty: use at least one queue name, e.g. queues=('default',)")
        for q in queues:
            check_queue_name(q)
        check_positive("concurrency", concurrency, integer=True)
        if batch_size is None:
            batch_size = default_batch_size(concurrency)
        check_positive("batch_size", batch_size, integer=True)
        check_positive("lease", lease, integer=False)
        check_positive("poll_interval", poll_interval, integer=False)
        # NaN, a bool or an int past a float's range is refused; inf (wait for running
        # handlers however long they take) stays allowed.
        if not (is_number(shutdown_timeout) and shutdown_timeout >= 0) \
                and shutdown_timeout != float("inf"):
            raise ConfigurationError(
                f"shutdown_timeout={shutdown_timeout!r}: use a number of seconds >= 0")
        self.queue = queue
        self.queues = tuple(dict.fromkeys(queues))
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.lease = float(lease)
        self.poll_interval = float(poll_interval)
        self.shutdown_timeout = float(shutdown_timeout)
        self.listen = listen
        # Where this run LISTENs: the queue's listen_dsn, None when it polls (_run).
        self._listen_at: str | None = None
        self.flush_interval = flush_interval
        self.reap_interval = reap_interval if reap_interval is not None else min(5.0, lease / 2)
        check_positive("prune_interval", prune_interval, integer=False)
        self.prune_interval = float(prune_interval)
        if vacuum_interval is not None:
            check_positive("vacuum_interval", vacuum_interval, integer=False)
        # None leaves the hot table to autovacuum alone.
        self.vacuum_interval = vacuum_interval
        if metrics_port is not None and not int_between(metrics_port, 0, 65535):
            raise ConfigurationError(f"metrics_port={metrics_port!r}: use a TCP port number "
                                     "from 1 to 65535 (0 picks a free one), or None")
        # Each sample counts the jobs table: a tiny interval is the query storm it avoids.
        check_positive("metrics_interval", metrics_interval, integer=False, least=0.1)
        if not isinstance(metrics_host, str) or not metrics_host:
            raise ConfigurationError(f"metrics_host={metrics_host!r}: use an address to listen "
                                     "on, e.g. '0.0.0.0' or '127.0.0.1'")
        self.metrics_host = metrics_host
        self.metrics_port = metrics_port
        self.metrics_interval = float(metrics_interval)
        # Made now: a missing prometheus extra is a mistake to report before run().
        self.metrics = metrics.collector(queue) if metrics_port is not None else None
        self.metrics_server: metrics.MetricsServer | None = None
        if name is not None:
            check_name("worker name", name, "web-1")
        # locked_by: unique per run, so a restarted worker of the same name is fenced off from
        # its predecessor's stale attempts.
        base = name or f"{socket.gethostname()}-{os.getpid()}"
        self.id = f"{base}-{uuid.uuid4().hex[:8]}"
        self.name = base
        # The handlers running, the outcomes not yet written, the jobs let go for a lost
        # lease: what the heartbeat renews and what a release of lost claim rows leaves alone.
        self._running = Running(self._execute, lease=self.lease, pending=self._pending)
        # Limited tasks declared on queues this worker does not serve: it claims without their
        # limits, so a job of theirs it claims is moved to the task's queue, not run (set in
        # run(); misplaced.py).
        self._refused: frozenset[str] = frozenset()
        self._mover: Mover | None = None
        # Events need a running loop; they are made in run(). stop() may come earlier.
        self._stop_requested = False
        self._stop: anyio.Event | None = None
        self.fetcher: Fetcher | None = None
        self.completer: Completer | None = None
        self.listener: Listener | None = None
        self.heartbeat: Heartbeat | None = None
        self.reaper: Reaper | None = None
        self.pruner: Pruner | None = None
        self.vacuum: HotTableVacuum | None = None
        self.scheduler: Scheduler | None = None
        self.elector: Elector | None = None
        self.services: ServiceRunner | None = None
        self.completed = 0

    def __repr__(self) -> str:
        return f"<asyncjobq.Worker {self.id} queues={list(self.queues)}>"

    # --- control ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to stop: no more claims, running jobs get `shutdown_timeout`."""
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()
        if self.fetcher is not None:
            self.fetcher.stop()

    @property
    def moved(self) -> int:
        """Jobs of limited tasks this worker claimed from a queue other than their task's and
        moved there unrun (their task's workers apply its limits; misplaced.py)."""
        return self._mover.moved if self._mover is not None else 0

    @property
    def running_jobs(self) -> list[Job]:
        """The jobs whose handlers this worker is running now."""
        return self._running.jobs()

    # --- run -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Open the queue, check its schema, and run jobs until `stop()`; then let running
        handlers finish (up to `shutdown_timeout`), write their outcomes and resign the
        leadership. It does not close the queue.

        Raises `ConfigurationError` for a schedule whose task is not registered, and
        `SchemaNotInstalledError` or `SchemaVersionError` when the schema is not at this
        version's migrations.
        """
        self._stop = anyio.Event()
        if self._stop_requested:
            self._stop.set()
        # A schedule whose task is missing fails now, not at its first tick.
        schedules = self.queue.check_schedules()
        self._threads = ThreadRunner(f"asyncjobq-{self.id}")
        cache_long_statements()
        await self.queue.open()
        async with self.queue.connection() as conn:
            await migrations.check(conn, self.queue.schema)
        db = self.queue.database
        # An app that registered asyncjobq.metrics.collector(queue) itself gets the worker's
        # part of the metrics (flushes, depth, leader) without a port of ours.
        collected = self.metrics or metrics.attached(self.queue)
        traced = tracing.instrument_worker(self.queue.hooks.middleware)
        if traced is not None:
            self.queue.hooks.middleware = traced
            self.queue.hooks.active = True
        self._progress = ProgressWriter(db, self.id)
        self._control = Control(self._running, self._progress, db)
        fetcher = self.fetcher = Fetcher(
            db, self.id, self.queues, batch_size=self.batch_size, control=self._control,
            concurrency=self.concurrency, poll_interval=self.poll_interval,
            free_slots=self._free_slots, dispatch=self._running.dispatch,
            keep=self._running.keep, claimed=self._claimed,
            folding=lambda: self.completer is not None and self.completer.folds_soon(),
            # Only the limits of tasks declared on this worker's queues: any limit sent makes
            # every claim the slower limited one (docs/guides/flow-control.md), and a limited
            # task's jobs are in its own queue (Queue.enqueue refuses any other; one written
            # elsewhere, from SQL or the CLI, is moved there unrun, see _execute).
            limits={t.name: lim for t in self.queue.tasks.values()
                    if t.queue in self.queues and (lim := t.limits) is not None})
        self._refused = frozenset(t.name for t in self.queue.tasks.values()
                                  if t.queue not in self.queues and t.limits is not None)
        self._mover = Mover(db, self.id)
        completer = self.completer = Completer(
            db, self.id, max_batch=self.batch_size, flush_interval=self.flush_interval,
            on_written=self._written, fetcher=fetcher,
            urgent=frozenset(t.name for t in self.queue.tasks.values() if t.key_limit),
            on_flushed=collected.observe_flush if collected is not None else None)
        heartbeat = self.heartbeat = Heartbeat(
            db, self.id, lease=self.lease, renew=self._running.leased,
            running_tasks=self._running.tasks, on_lost=self._running.lease_lost,
            on_cut_off=self._running.cut_off,
            on_cancel=lambda keys: self._running.cancel_requested(keys=keys))
        self.pruner = Pruner(db, self.queue.retention, interval=self.prune_interval)
        # The leader's vacuum holds a session lock while VACUUM runs: nothing a transaction
        # pooler can keep. Behind one, the table is left to autovacuum.
        self.vacuum = (HotTableVacuum(db, interval=self.vacuum_interval)
                       if self.vacuum_interval is not None and not db.pooled else None)
        self._listen_at = db.listen_dsn if self.listen else None
        if self.listen and self._listen_at is None:
            log.warning(
                "worker %s: the database is reached through a transaction pooler, where "
                "LISTEN hears nothing: polling every %g s (Queue(listen_dsn=...), a direct "
                "connection to PostgreSQL, wakes workers at once)", self.id, self.poll_interval)
        if db.pooled and self.vacuum_interval is not None:
            log.info("worker %s: behind a transaction pooler the leader leaves the vacuum of "
                     "%s.jobs to autovacuum", self.id, db.schema)
        self.reaper = Reaper(db, lease=self.lease, interval=self.reap_interval,
                             hooks=self.queue.hooks,
                             observe=collected.observe_reaped if collected is not None else None)
        # The leader's row lasts one lease: a killed leader is replaced as its jobs are.
        elector = self.elector = Elector(db, self.id, ttl=self.lease,
                                         on_change=self._leader_changed)
        # Empties the other generation of jobs by TRUNCATE while the xmin horizon is held.
        self.rotation = Rotation(db)
        maintenance: list[Service] = [elector, self.reaper, self.pruner, self.rotation]
        if self.vacuum is not None:
            maintenance.append(self.vacuum)
        if schedules:
            # Ticks missed for two leases (a leader's takeover takes about one) are all
            # enqueued late; a longer gap means no worker ran (scheduler.py).
            self.scheduler = Scheduler(db, schedules, grace=2 * self.lease)
            maintenance.append(self.scheduler)
        if collected is not None:
            maintenance.append(DepthSampler(self.queue.stats, collected.set_depth,
                                            interval=self.metrics_interval))
            collected.add_worker(self.id, lambda: elector.is_leader)
        self.services = ServiceRunner(maintenance, is_leader=lambda: elector.is_leader)
        if self._stop_requested:
            fetcher.stop()
        loop = type(asyncio.get_running_loop())
        log.info("worker %s started: queues=%s concurrency=%d batch=%d lease=%.1fs loop=%s.%s",
                 self.id, ",".join(self.queues), self.concurrency, self.batch_size, self.lease,
                 loop.__module__, loop.__qualname__)
        if self.metrics is not None and self.metrics_port is not None:
            self.metrics_server = metrics.serve(self.metrics, self.metrics_port,
                                                self.metrics_host)
            log.info("metrics at http://%s:%d/metrics", self.metrics_server.host,
                     self.metrics_server.port)
        heartbeat.start()
        try:
            await self._serve(fetcher, completer, heartbeat, self.services)
        finally:
            heartbeat.stop()
            self._threads.close()
            if collected is not None:
                collected.remove_worker(self.id)
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.metrics_server = None
        log.info("worker %s stopped: %d job(s) completed, %d outcome(s) refused", self.id,
                 self.completed, completer.refused)

    async def _serve(self, fetcher: Fetcher, completer: Completer, heartbeat: Heartbeat,
                     runner: ServiceRunner) -> None:
        async with anyio.create_task_group() as services:
            services.start_soon(completer.run)
            services.start_soon(heartbeat.tick)
            services.start_soon(runner.run)
            services.start_soon(self._progress.run)
            services.start_soon(fetcher.watch_generation)
            if self._listen_at is not None:
                # Floors need notifications: a worker that polls never claims from them.
                services.start_soon(fetcher.watch_horizon)
                self.listener = Listener(
                    self._listen_at, self.queue.channel, fetcher.notify,
                    fetcher.listening,
                    on_disconnect=fetcher.deaf,
                    application_name=f"{self.queue.application_name}-listen",
                    also={self.queue.database.cancel_channel: self._control.cancel_notified,
                          self.queue.database.generation_channel:
                              fetcher.generation_notified})
                services.start_soon(self.listener.run)
            try:
                await self._fetch_then_shutdown(fetcher, completer)
            finally:
                # Torn down (cancelled) rather than stopped: handlers still running are
                # cancelled with it; their jobs stay running in the table until reaped.
                self._running.abandon_all()
            services.cancel_scope.cancel()

    async def _fetch_then_shutdown(self, fetcher: Fetcher, completer: Completer) -> None:
        assert self._stop is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(fetcher.run)
            await self._stop.wait()
            fetcher.stop()
        # Nothing new is claimed now, except by a flush already in flight: let it land first.
        await completer.settle(timeout=self.shutdown_timeout)
        # Let running handlers finish...
        if self._running:
            log.info("stopping: waiting up to %g s for %d running job(s)",
                     self.shutdown_timeout, len(self._running))
            with anyio.move_on_after(self.shutdown_timeout):
                await self._running.all_finished()
        # ...then cancel the rest; their executors record them as released back to queued.
        if self._running:
            log.warning("stopping: cancelling %d job(s) still running after %g s: %s",
                        len(self._running), self.shutdown_timeout, self._running.describe())
            self._running.cancel_all("shutdown")
            with anyio.move_on_after(5.0):
                await self._running.all_finished()
            if self._running:  # sync bodies that cannot be interrupted
                log.warning("stopping: %d handler(s) still running after being cancelled; "
                            "leaving their jobs to be reaped after the lease: %s",
                            len(self._running), self._running.describe())
        await completer.drain(timeout=10.0)
        await self.queue.hooks.settle(timeout=5.0)
        # Rows of a claim whose reply was lost go back now rather than after the lease.
        await fetcher.release_lost_claims_at_exit()
        await self._resign()

    async def _resign(self) -> None:
        # Another worker leads from its next turn instead of after this row expires. The
        # services stop first: an elector turn still in flight could write the row back.
        if self.services is not None:
            await self.services.stop()
        if self.elector is None:
            return
        try:
            await self.elector.resign()
        except (psycopg.Error, PoolTimeout) as e:
            log.warning("could not resign the leadership (%s); another worker takes over when "
                        "it expires", reason(e))

    def _leader_changed(self, worker_id: str | None) -> None:
        collected = self.metrics or metrics.attached(self.queue)
        if collected is not None and worker_id != self.id:
            collected.clear_depth()
        if self.queue.hooks.on_leader_changed:
            self.queue.hooks.spawn("on_leader_changed", worker_id=worker_id)

    def _free_slots(self) -> int:
        # Jobs whose outcomes wait beyond what the completer's lanes write at once still hold
        # their slots: claiming past the completer would pile up running rows that every flush
        # must join against.
        c = self.completer
        unwritten = max(0, c.backlog - c.capacity) if c is not None else 0
        return self.concurrency - len(self._running) - unwritten

    async def _execute(self, running: RunningJob) -> None:
        running.begun = True
        job = running.job
        if job_module.TRACK_CURRENT_JOB:
            current_job.set(job)  # this task's own context: its log lines name the job
        assert self.completer is not None and self.fetcher is not None
        outcome: Outcome | None = None
        hooks = self.queue.hooks if self.queue.hooks.active else None
        # A job cancelled before this first step runs no handler and is not moved either:
        # execute() gives it the outcome its cancel's reason says.
        misplaced = job.task in self._refused and not running.called_off
        try:
            if misplaced:
                # Not an attempt: moved to its task's queue, uncounted, without an outcome to
                # write, an on_started or an on_finished (its attempt there reports those).
                assert self._mover is not None
                await self._mover.move(job, self.queue.tasks[job.task])
            else:
                outcome = await execute(running, self.queue.tasks.get(job.task),
                                        self.queue.tasks, self._threads, hooks,
                                        self.queue.max_result_bytes)
        finally:
            if hooks is not None and hooks.on_finished and not misplaced:
                hooks.spawn("on_finished", job=job, outcome=finished(outcome, running),
                            duration=time.monotonic() - running.started)
            self._running.finish(running)
            if outcome is not None:
                # The last handler running, and the last claim found the queue empty: no
                # outcome will join this one soon, so it is written now, not after
                # flush_interval (a Queue.wait on the job returns that much sooner). While
                # claims come back full, outcomes are batched as before.
                self.completer.add(outcome, last=not self._running and self.fetcher.found_less)
            self.fetcher.release_slot()

    def _claimed(self, jobs: list[Job]) -> None:
        if self.queue.hooks.on_claimed:
            self.queue.hooks.spawn("on_claimed", jobs=jobs)

    def _written(self, outcomes: list[Outcome]) -> None:
        assert self.fetcher is not None
        self.fetcher.release_slot()  # their slots were held until now (see _free_slots)
        for o in outcomes:
            if o.kind == "done":
                self.completed += 1
            elif o.kind in ("retry", "snooze") and o.delay < self.poll_interval:
                # Our own retry is due before the next poll: wake up for it.
                self.fetcher.wakeup.at(time.monotonic() + o.delay)

    def _pending(self) -> list[tuple[int, int]]:
        """(id, attempt) of the outcomes not written yet; called from the heartbeat thread."""
        assert self.completer is not None
        return self.completer.pending()
