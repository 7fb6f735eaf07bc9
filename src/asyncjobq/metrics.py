"""Prometheus metrics (docs/reference/metrics.md; extra `asyncjobq[prometheus]`).

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

import math
import time
import weakref
from bisect import bisect_left
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
#: Bucket bounds (seconds) of asyncjobq_job_duration_seconds.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0, 600.0)
#: Bucket bounds (seconds) of asyncjobq_job_pickup_seconds.
PICKUP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                  60.0, 300.0, 900.0, 3600.0)
#: Bucket bounds (seconds) of asyncjobq_outcome_flush_seconds.
FLUSH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

_collectors: weakref.WeakKeyDictionary[Hooks, QueueCollector] = weakref.WeakKeyDictionary()


class _Histogram:
    """Bucket counts and a sum, kept as plain numbers: observing is a bisect and two adds."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, as the exposition format has them (repr() writes
        these bounds as Go does, which Prometheus expects: "0.005", "1.0", "+Inf")."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), tuple(self.counts), strict=True):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), float(total)))
        return out


class QueueCollector:
    """The metrics of one Queue, a prometheus_client collector (it has `collect()`).

    Its `on_*` methods observe the queue's events (hooks.py, inline); the worker feeds it the
    outcome flushes, the reaped jobs, the sampled depth and whether it leads. The counts are
    plain numbers, turned into metric families only when scraped: prometheus_client's own
    Counter and Histogram take a lock per update and cost about 5 us per job between them,
    a tenth of a zero-work job's time in the worker (benchmarks/metrics_ab.py). The loop
    writes them, a scrape reads copies of them; either can only see a count one update old.
    """

    def __init__(self) -> None:
        try:
            import prometheus_client  # noqa: F401  (the families are built from it at scrape)
        except ImportError:
            raise ExtraNotInstalledError(_INSTALL) from None
        self._finished: dict[tuple[str, str, str], int] = {}
        self._duration: dict[tuple[str, str], _Histogram] = {}
        self._pickup: dict[str, _Histogram] = {}
        self._claimed: dict[str, int] = {}
        self._running: dict[str, int] = {}
        self._reaped: dict[tuple[str, str, str], int] = {}
        self._flush = _Histogram(FLUSH_BUCKETS)
        self._depth: dict[tuple[str, str], int] = {}
        self._sampled_at = 0.0
        # (id, attempt) of the jobs whose start was counted: a finish without a counted start
        # (an unknown task, a job cancelled before it started) must not push the gauge below 0.
        self._started: set[tuple[int, int]] = set()
        self._leaders: dict[str, Callable[[], bool]] = {}

    # --- prometheus_client's collector interface ----------------------------------------

    def collect(self) -> Iterator[Metric]:
        """The metric families as a scrape sees them now (prometheus_client calls it)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        # dict(): a copy taken at once, while the loop may add a label set meanwhile.
        counts: tuple[tuple[Callable[..., CounterMetricFamily | GaugeMetricFamily], str, str,
                            list[str], dict[Any, int]], ...] = (
            (CounterMetricFamily, "asyncjobq_jobs_finished", "Attempts finished, by outcome "
             "(a failed attempt with retries left is 'retry').", ["queue", "task", "outcome"],
             dict(self._finished)),
            (CounterMetricFamily, "asyncjobq_jobs_claimed",
             "Jobs claimed by this process's workers.", ["queue"],
             {(q,): n for q, n in dict(self._claimed).items()}),
            (GaugeMetricFamily, "asyncjobq_running_jobs", "Handlers running in this process.",
             ["queue"], {(q,): n for q, n in dict(self._running).items()}),
            (GaugeMetricFamily, "asyncjobq_queue_jobs", "Jobs by queue and status, sampled "
             "from the database by the leader.", ["queue", "status"], self._depth),
            (CounterMetricFamily, "asyncjobq_jobs_reaped", "Running jobs of dead workers taken "
             "back by the leader's reaper: requeued, or failed with their attempts spent.",
             ["queue", "task", "result"], dict(self._reaped)),
        )
        for kind, name, doc, labels, values in counts:
            family = kind(name, doc, labels=labels)
            for key, n in values.items():
                family.add_metric(list(key), n)
            yield family
        histograms: tuple[tuple[str, str, list[str], dict[Any, _Histogram]], ...] = (
            ("asyncjobq_job_duration_seconds", "Handler time of each attempt.",
             ["queue", "task"], dict(self._duration)),
            ("asyncjobq_job_pickup_seconds", "From the job's run_at to its handler's start.",
             ["queue"], {(q,): h for q, h in dict(self._pickup).items()}),
            ("asyncjobq_outcome_flush_seconds", "Time of each outcome-writing statement.", [],
             {(): self._flush}),
        )
        for name, doc, labels, hists in histograms:
            hist = HistogramMetricFamily(name, doc, labels=labels)
            for key, h in hists.items():
                hist.add_metric(list(key), h.buckets(), h.sum)
            yield hist
        yield GaugeMetricFamily(
            "asyncjobq_queue_jobs_sampled_timestamp_seconds", "When asyncjobq_queue_jobs was "
            "last sampled (Unix time): a value that stops moving means stale depths.",
            value=self._sampled_at)
        yield GaugeMetricFamily(
            "asyncjobq_leader", "1 when a worker of this process leads its schema.",
            value=self._leads())

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def value(self, name: str, **labels: str) -> float:
        """One sample of a scrape, 0 when absent (tests, health checks of your own)."""
        want = set(labels.items())
        for family in self.collect():
            for sample in family.samples:
                if sample.name == name and set(sample.labels.items()) == want:
                    return float(sample.value)
        return 0.0

    # --- observed events (hooks.py: plain methods, called inline) ----------------------------

    def on_claimed(self, jobs: list[Job]) -> None:
        claimed = self._claimed
        for job in jobs:
            claimed[job.queue] = claimed.get(job.queue, 0) + 1

    def on_started(self, job: Job) -> None:
        self._started.add((job.id, job.attempt))
        q = job.queue
        self._running[q] = self._running.get(q, 0) + 1
        pickup = self._pickup.get(q)
        if pickup is None:
            pickup = self._pickup[q] = _Histogram(PICKUP_BUCKETS)
        # run_at is the server's clock: a worker's clock a little behind must not observe < 0.
        pickup.observe(max(0.0, time.time() - job.run_at.timestamp()))

    def on_finished(self, job: Job, outcome: Finished, duration: float) -> None:
        key = (job.id, job.attempt)
        if key in self._started:
            self._started.discard(key)
            self._running[job.queue] -= 1
        labels = (job.queue, job.task, outcome)
        self._finished[labels] = self._finished.get(labels, 0) + 1
        pair = (job.queue, job.task)
        took = self._duration.get(pair)
        if took is None:
            took = self._duration[pair] = _Histogram(DURATION_BUCKETS)
        took.observe(duration)

    # --- fed by the worker ----------------------------------------------------------------

    def observe_flush(self, seconds: float) -> None:
        self._flush.observe(seconds)

    def observe_reaped(self, rows: list[tuple[str, str, str]]) -> None:
        """(queue, task, status after the reaper: queued or failed) of each job taken back."""
        for queue, task, status in rows:
            labels = (queue, task, "requeued" if status == "queued" else status)
            self._reaped[labels] = self._reaped.get(labels, 0) + 1

    def set_depth(self, counts: dict[str, dict[str, int]]) -> None:
        # Replaced whole: a queue gone from the database (its jobs pruned) stops being exported.
        self._depth = {(q, status): n for q, statuses in counts.items()
                       for status, n in statuses.items()}
        self._sampled_at = time.time()

    def clear_depth(self) -> None:
        """No longer the leader: another process samples now, stale values would mislead."""
        self._depth = {}
        self._sampled_at = 0.0

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
    registered as an observer of the queue's hooks; register it in a prometheus_client
    registry to serve it. Raises `ExtraNotInstalledError` without prometheus-client (the
    `prometheus` extra)."""
    hooks = getattr(queue, "hooks", None)
    if not isinstance(hooks, Hooks):
        raise ConfigurationError(f"metrics.collector({queue!r}): pass the asyncjobq.Queue whose "
                                 "jobs to count")
    found = _collectors.get(hooks.origin)
    if found is None:
        found = _collectors[hooks.origin] = QueueCollector()
    hooks.add_observer(found)  # not twice; again on hooks a test block replaced (hooks.copy)
    return found


def attached(queue: Queue) -> QueueCollector | None:
    """The collector made for `queue` by collector(), if any."""
    return _collectors.get(queue.hooks.origin)


class MetricsServer:
    """/metrics of one collector over HTTP, served by prometheus_client from a thread.

    Attributes:
        host: the address it listens on.
        port: the port it listens on (the one picked, when asked for port 0).
    """

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
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


def serve(collected: QueueCollector, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `collected` at http://<host>:<port>/metrics from a thread (what
    `Worker(metrics_port=...)` does); `MetricsPortInUseError` when the port is taken."""
    return MetricsServer(collected, port, host)
