"""Prometheus metrics (DESIGN §10; extra `asyncjobq[prometheus]`).

`Worker(metrics_port=9464)` (`worker --metrics-port 9464`) serves them at /metrics; an app that
serves its own registry registers `collector(queue)` in it:

    from prometheus_client import REGISTRY
    REGISTRY.register(asyncjobq.metrics.collector(queue))

The collector watches jobs as an observer of the queue's hooks (claimed, started, finished:
called inline, so a slow hook of yours neither delays nor drops a count; hooks.py), so it sees
what the workers of *this process* run on that queue; the leader's reaper tells it of jobs it
took back from dead workers (`asyncjobq_jobs_reaped_total`). `asyncjobq_queue_jobs` comes from the
database: the leader's sampler reads the counts by queue and status every `metrics_interval`
seconds, so only the leader's process exports it (aggregate it with `max by (queue, status)`).
Labels are bounded: queue, task and outcome names, never job ids or error texts.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError, ExtraNotInstalledError, MetricsPortInUseError
from .hooks import Finished, Hooks
from .job import Job

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .queue import Queue

_INSTALL = ("Prometheus metrics need the prometheus extra: pip install 'asyncjobq[prometheus]' "
            "(prometheus-client)")

# Seconds: handlers from a millisecond to ten minutes; pickup from sub-millisecond (a warm
# worker) to an hour of backlog; flushes are statements, a few ms when healthy.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0, 600.0)
PICKUP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                  60.0, 300.0, 900.0, 3600.0)
FLUSH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

_collectors: weakref.WeakKeyDictionary[Hooks, QueueCollector] = weakref.WeakKeyDictionary()


class QueueCollector:
    """The metrics of one Queue, a prometheus_client collector (it has `collect()`).

    Its `on_*` methods are the queue's hooks; the worker feeds it the outcome flushes, the
    sampled depth and whether it leads."""

    def __init__(self) -> None:
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:
            raise ExtraNotInstalledError(_INSTALL) from None
        # registry=None: these live in this collector, which any registry (ours or the
        # app's) can hold.
        self.finished = Counter(
            "asyncjobq_jobs_finished", "Attempts finished, by outcome (a failed attempt with "
            "retries left is 'retry').", ["queue", "task", "outcome"], registry=None)
        self.duration = Histogram(
            "asyncjobq_job_duration_seconds", "Handler time of each attempt.",
            ["queue", "task"], buckets=DURATION_BUCKETS, registry=None)
        self.pickup = Histogram(
            "asyncjobq_job_pickup_seconds", "From the job's run_at to its handler's start.",
            ["queue"], buckets=PICKUP_BUCKETS, registry=None)
        self.claimed = Counter(
            "asyncjobq_jobs_claimed", "Jobs claimed by this process's workers.", ["queue"],
            registry=None)
        self.running = Gauge(
            "asyncjobq_running_jobs", "Handlers running in this process.", ["queue"],
            registry=None)
        self.depth = Gauge(
            "asyncjobq_queue_jobs", "Jobs by queue and status, sampled from the database by "
            "the leader.", ["queue", "status"], registry=None)
        self.flush = Histogram(
            "asyncjobq_outcome_flush_seconds", "Time of each outcome-writing statement.",
            buckets=FLUSH_BUCKETS, registry=None)
        self.leader = Gauge(
            "asyncjobq_leader", "1 when a worker of this process leads its schema.",
            registry=None)
        self.leader.set_function(self._leads)
        self.reaped = Counter(
            "asyncjobq_jobs_reaped", "Running jobs of dead workers taken back by the leader's "
            "reaper: requeued, or failed with their attempts spent.",
            ["queue", "task", "result"], registry=None)
        self.sampled_at = Gauge(
            "asyncjobq_queue_jobs_sampled_timestamp_seconds", "When asyncjobq_queue_jobs was "
            "last sampled (Unix time): a value that stops moving means stale depths.",
            registry=None)
        self._metrics = (self.finished, self.duration, self.pickup, self.claimed, self.running,
                         self.depth, self.flush, self.leader, self.reaped, self.sampled_at)
        # (id, attempt) of the jobs whose start was counted: a finish without a counted start
        # (an unknown task, a job cancelled before it started) must not push the gauge below 0.
        self._started: set[tuple[int, int]] = set()
        self._leaders: dict[str, Callable[[], bool]] = {}
        self._queue_children: dict[str, tuple[Any, Any]] = {}
        self._task_children: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        self._sampled: set[tuple[str, str]] = set()

    # --- prometheus_client's collector interface ----------------------------------------

    def collect(self) -> Iterator[Metric]:
        for m in self._metrics:
            yield from m.collect()

    def describe(self) -> Iterable[Metric]:
        for m in self._metrics:
            yield from m.describe()

    # --- observed events (hooks.py: plain methods, called inline) ----------------------------

    def on_claimed(self, jobs: list[Job]) -> None:
        by_queue: dict[str, int] = {}
        for job in jobs:
            by_queue[job.queue] = by_queue.get(job.queue, 0) + 1
        for q, n in by_queue.items():
            self.claimed.labels(q).inc(n)

    # labels() takes a lock and builds a key on every call: the children of each queue (and
    # queue and task) are looked up once and kept, which halves the collector's cost per job.
    def _of_queue(self, queue: str) -> tuple[Any, Any]:
        found = self._queue_children.get(queue)
        if found is None:
            found = self._queue_children[queue] = (self.running.labels(queue),
                                                   self.pickup.labels(queue))
        return found

    def _of_task(self, queue: str, task: str) -> tuple[Any, dict[str, Any]]:
        found = self._task_children.get((queue, task))
        if found is None:
            found = self._task_children[queue, task] = (self.duration.labels(queue, task), {})
        return found

    def on_started(self, job: Job) -> None:
        self._started.add((job.id, job.attempt))
        running, pickup = self._of_queue(job.queue)
        running.inc()
        # run_at is the server's clock: a worker's clock a little behind must not observe < 0.
        pickup.observe(max(0.0, time.time() - job.run_at.timestamp()))

    def on_finished(self, job: Job, outcome: Finished, duration: float) -> None:
        key = (job.id, job.attempt)
        if key in self._started:
            self._started.discard(key)
            self._of_queue(job.queue)[0].dec()
        took, finished = self._of_task(job.queue, job.task)
        counter = finished.get(outcome)
        if counter is None:
            counter = finished[outcome] = self.finished.labels(job.queue, job.task, outcome)
        counter.inc()
        took.observe(duration)

    # --- fed by the worker ----------------------------------------------------------------

    def observe_flush(self, seconds: float) -> None:
        self.flush.observe(seconds)

    def observe_reaped(self, rows: list[tuple[str, str, str]]) -> None:
        """(queue, task, status after the reaper: queued or failed) of each job taken back."""
        for queue, task, status in rows:
            self.reaped.labels(queue, task, "requeued" if status == "queued" else status).inc()

    def set_depth(self, counts: dict[str, dict[str, int]]) -> None:
        seen = set()
        for q, statuses in counts.items():
            for status, n in statuses.items():
                self.depth.labels(q, status).set(n)
                seen.add((q, status))
        # A queue gone from the database (its jobs pruned) stops being exported.
        for q, status in self._sampled - seen:
            self.depth.remove(q, status)
        self._sampled = seen
        self.sampled_at.set_to_current_time()

    def clear_depth(self) -> None:
        """No longer the leader: another process samples now, stale values would mislead."""
        self.depth.clear()
        self._sampled = set()
        self.sampled_at.set(0)

    def add_worker(self, worker_id: str, is_leader: Callable[[], bool]) -> None:
        self._leaders[worker_id] = is_leader

    def remove_worker(self, worker_id: str) -> None:
        self._leaders.pop(worker_id, None)
        if not self._leads():
            # No worker of this process samples now: its last depths would go on looking
            # current to `max by (queue, status)` in an app that keeps serving its registry.
            self.clear_depth()

    def _leads(self) -> float:
        return 1.0 if any(f() for f in tuple(self._leaders.values())) else 0.0


def collector(queue: Queue) -> QueueCollector:
    """The metrics collector of `queue` (one per queue: calling again returns the same one),
    registered as the queue's hook; register it in a prometheus_client registry to serve it."""
    hooks = getattr(queue, "hooks", None)
    if not isinstance(hooks, Hooks):
        raise ConfigurationError(f"metrics.collector({queue!r}): pass the asyncjobq.Queue whose "
                                 "jobs to count")
    found = _collectors.get(hooks)
    if found is None:
        found = _collectors[hooks] = QueueCollector()
        hooks.add_observer(found)
    return found


def attached(queue: Queue) -> QueueCollector | None:
    """The collector made for `queue` by collector(), if any."""
    return _collectors.get(queue.hooks)


class MetricsServer:
    """/metrics of one collector over HTTP, served by prometheus_client from a thread."""

    def __init__(self, collected: QueueCollector, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=True)
        registry.register(collected)
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            raise MetricsPortInUseError(
                f"metrics port {port} on {addr} is not available ({e.strerror or e}): stop "
                "what holds it or pick another with --metrics-port / metrics_port= (or "
                "another address with --metrics-host / metrics_host=)") from None
        self.host = str(self._server.server_address[0])
        self.port = int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def serve(collected: QueueCollector, port: int, host: str = "0.0.0.0") -> MetricsServer:
    return MetricsServer(collected, port, host)
