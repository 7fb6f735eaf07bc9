"""Prometheus metrics and OpenTelemetry traces (DESIGN §10, issue 20)."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fetchval, run_cli, running, spawn_worker, wait_for
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once
from prometheus_client.parser import text_string_to_metric_families

from asyncjobq import Fail, Job, Queue, Worker
from asyncjobq import tracing as jobq_tracing
from asyncjobq.errors import MetricsPortInUseError

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


async def test_metrics_match_the_database_after_a_drain(queue: Queue) -> None:
    @queue.task(name="ok")
    async def ok(job: Job) -> None:
        pass

    @queue.task(name="flaky", max_attempts=3, backoff=lambda attempt: 0.0)
    async def flaky(job: Job) -> None:
        if job.attempt == 1:
            raise RuntimeError("fails once")

    @queue.task(name="doomed")
    async def doomed(job: Job) -> None:
        raise Fail("fails for good")

    await queue.enqueue_many("ok", [{"i": i} for i in range(890)])
    await queue.enqueue_many("flaky", [{"i": i} for i in range(100)])
    await queue.enqueue_many("doomed", [{"i": i} for i in range(10)])
    worker = Worker(queue, concurrency=20, metrics_port=0, metrics_interval=0.5,
                    poll_interval=0.1)
    async with running(worker):
        assert worker.metrics_server is not None
        port = worker.metrics_server.port

        async def drained() -> bool:
            counts = (await queue.stats())["default"]
            return counts["done"] == 990 and counts["failed"] == 10

        await wait_for(drained, 60, what="1,000 jobs drained")
        # Hooks run in tasks of their own: wait for the last finish to be counted.
        await wait_for(lambda: total(scrape(port), "asyncjobq_jobs_finished_total") == 1100,
                       10, what="every finish counted")
        m = scrape(port)

        # The database's truth, per outcome.
        counts = (await queue.stats())["default"]
        attempts = int(await fetchval(
            queue, "SELECT sum(attempts) FROM (SELECT attempts FROM {s}.jobs"
                   " UNION ALL SELECT attempts FROM {s}.jobs_history) a"))
        failed_attempts_retried = attempts - 1000  # every attempt beyond a job's last
        assert counts["done"] == 990 and counts["failed"] == 10 and attempts == 1100
        finished = "asyncjobq_jobs_finished_total"
        assert total(m, finished, outcome="done") == counts["done"]
        assert total(m, finished, outcome="failed") == counts["failed"]
        assert total(m, finished, outcome="retry") == failed_attempts_retried
        assert value(m, finished, queue="default", task="ok", outcome="done") == 890
        assert value(m, finished, queue="default", task="flaky", outcome="retry") == 100
        assert value(m, finished, queue="default", task="flaky", outcome="done") == 100
        assert value(m, finished, queue="default", task="doomed", outcome="failed") == 10
        assert total(m, finished, outcome="snoozed") == 0
        # Labels are bounded: queue, task and outcome only.
        labels = {k for (n, ls), _ in m.items() if n.startswith("asyncjobq_") for k, _ in ls}
        assert labels <= {"queue", "task", "outcome", "status", "le"}, labels

        # Histograms: one observation per attempt.
        assert total(m, "asyncjobq_job_duration_seconds_count") == attempts
        assert value(m, "asyncjobq_job_duration_seconds_count", queue="default",
                     task="flaky") == 200
        assert value(m, "asyncjobq_job_pickup_seconds_count", queue="default") == attempts
        assert value(m, "asyncjobq_job_pickup_seconds_bucket", queue="default",
                     le="+Inf") == attempts
        assert value(m, "asyncjobq_jobs_claimed_total", queue="default") == attempts
        assert value(m, "asyncjobq_running_jobs", queue="default") == 0
        # Every outcome was written by some flush; a flush writes up to a batch.
        flushes = value(m, "asyncjobq_outcome_flush_seconds_count")
        assert attempts / worker.batch_size <= flushes <= attempts
        # The only worker leads, and samples the depth.
        assert value(m, "asyncjobq_leader") == 1

        # The depth gauge follows a backlog on a queue nobody serves within one interval.
        async def depth_is(n: int) -> bool:
            return value(scrape(port), "asyncjobq_queue_jobs", queue="backlog",
                         status="queued") == n

        for total_queued in (40, 65):
            await queue.enqueue_many("ok", [{}] * (total_queued - (40 if total_queued > 40
                                                                   else 0)), queue="backlog")
            started = time.monotonic()
            await wait_for(lambda n=total_queued: depth_is(n), 5, interval=0.05,
                           what=f"depth {total_queued}")
            # One interval (0.5 s) plus a turn's query and a scrape.
            assert time.monotonic() - started < 0.5 + 0.5
        m = scrape(port)
        assert value(m, "asyncjobq_queue_jobs", queue="default", status="done") == 990
        assert value(m, "asyncjobq_queue_jobs", queue="default", status="failed") == 10


async def test_collector_for_an_apps_own_registry(queue: Queue) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncjobq import metrics

    c = metrics.collector(queue)
    assert metrics.collector(queue) is c  # one per queue: hooks are not registered twice
    registry = CollectorRegistry()
    registry.register(c)

    @queue.task(name="t")
    async def t(job: Job) -> None:
        pass

    await queue.enqueue_many("t", [{}] * 5)
    async with running(Worker(queue, poll_interval=0.1, metrics_interval=0.2)):
        await wait_for(lambda: b'asyncjobq_jobs_finished_total{outcome="done",queue="default",'
                       b'task="t"} 5.0' in generate_latest(registry), 20, what="5 done")
        await wait_for(lambda: b'asyncjobq_queue_jobs{queue="default",status="done"} 5.0'
                       in generate_latest(registry), 10, what="depth sampled")


def test_metrics_port_in_use_is_one_line_and_exit_2(pg_dsn: str, schema: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_cli("install", "--schema", schema, dsn=pg_dsn).returncode == 0
        proc = spawn_worker(pg_dsn, schema, "--metrics-port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"metrics port {port}" in lines[0] and "--metrics-port" in lines[0], lines[0]
    assert "Traceback" not in err


async def test_worker_metrics_port_in_use_raises_an_error_naming_the_fix(queue: Queue) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        worker = Worker(queue, metrics_port=taken.getsockname()[1])
        with pytest.raises(MetricsPortInUseError, match="pick another"):
            await worker.run()


# --- traces --------------------------------------------------------------------------------

@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    try:
        yield memory
    finally:
        provider.shutdown()
        # The API sets a process's provider once and for all; the other tests of this process
        # run without tracing, so put back the unset state (as opentelemetry-test-utils'
        # reset_trace_globals does).
        trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
        trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]
        assert not jobq_tracing.enabled()


def read_spans(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_trace_crosses_processes_in_the_job(pg_dsn: str, queue: Queue, tmp_path: Path,
                                                  exporter: InMemorySpanExporter) -> None:
    assert jobq_tracing.enabled()
    app_tracer = trace.get_tracer("the-app")
    with app_tracer.start_as_current_span("web request") as app_span:
        one = await queue.enqueue("traced", {"fail_first": True})
        many = await queue.enqueue_many("traced", [{}, {}, {}], queue="other")
        doomed = await queue.enqueue("traced", {"fail_always": True}, max_attempts=2)
        keyed = await queue.enqueue("traced", {}, dedup_key="k")  # the single-statement path
    trace_id = f"{app_span.get_span_context().trace_id:032x}"
    untraced = await queue.enqueue("traced", {})  # outside any span: a trace of its own

    sent = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.PRODUCER]
    assert [s.name for s in sent] == ["send default", "send other", "send default",
                                      "send default", "send default"]
    for s in sent[:4]:
        assert s.parent is not None and s.parent.span_id == app_span.get_span_context().span_id
        assert s.attributes is not None and s.attributes["messaging.system"] == "asyncjobq"
    assert sent[0].attributes is not None and sent[0].attributes["messaging.message.id"] == \
        str(one)
    assert sent[1].attributes is not None
    assert sent[1].attributes["messaging.batch.message_count"] == 3
    assert sent[1].attributes["messaging.destination.name"] == "other"
    # The context travels in the row, not in memory.
    stored = await fetchval(queue, "SELECT trace_context FROM {s}.jobs WHERE id = %s", one)
    assert stored["traceparent"].split("-")[1] == trace_id

    spans_file = tmp_path / "spans.jsonl"
    proc = spawn_worker(pg_dsn, queue.schema, "--queue", "default", "--queue", "other",
                        app="apps.tracedapp:queue",
                        env={"ASYNCJOBQ_TEST_SPANS": str(spans_file)})
    try:
        # one: 2 attempts; many: 3; doomed: 2; keyed: 1; untraced: 1.
        await wait_for(lambda: len(read_spans(spans_file)) >= 9, 30, what="9 consumer spans")
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    spans = read_spans(spans_file)
    assert all(s["kind"] == "CONSUMER" for s in spans)
    by_job: dict[str, list[dict[str, object]]] = {}
    for s in spans:
        attrs = s["attributes"]
        assert isinstance(attrs, dict)
        by_job.setdefault(attrs["messaging.message.id"], []).append(s)

    def consumer(job_id: int) -> list[dict[str, object]]:
        return sorted(by_job[str(job_id)],
                      key=lambda s: s["attributes"]["asyncjobq.attempt"])  # type: ignore[index]

    first, retry = consumer(one)
    for s in (first, retry):  # a retry is a new span, child of the same producer span
        assert s["trace_id"] == trace_id
        assert s["parent_id"] == f"{sent[0].context.span_id:016x}"
        assert s["name"] == "process default"
        assert s["attributes"]["messaging.system"] == "asyncjobq"  # type: ignore[index]
        assert s["attributes"]["messaging.destination.name"] == "default"  # type: ignore[index]
    assert first["status"] == "ERROR" and first["events"] == ["exception"]
    assert retry["status"] == "UNSET" and retry["events"] == []
    for job_id in many:
        (s,) = consumer(job_id)
        assert s["trace_id"] == trace_id and s["name"] == "process other"
        assert s["parent_id"] == f"{sent[1].context.span_id:016x}"
    assert [s["status"] for s in consumer(doomed)] == ["ERROR", "ERROR"]
    (s,) = consumer(keyed)
    assert s["trace_id"] == trace_id and s["parent_id"] == f"{sent[3].context.span_id:016x}"
    (alone,) = consumer(untraced)
    assert alone["trace_id"] != trace_id
    assert alone["parent_id"] == f"{sent[4].context.span_id:016x}"
    assert len(spans) == 9


async def test_no_trace_context_without_a_provider_or_from_sql(queue: Queue) -> None:
    # A job written in SQL has no context; the worker runs it all the same (column NULL).
    await fetchval(queue, "INSERT INTO {s}.jobs (task, payload) VALUES ('t', '{{}}')"
                          " RETURNING id")
    ran: list[Job] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        ran.append(job)

    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: len(ran) == 1, 20, what="the SQL job ran")
    assert ran[0].trace_context is None


def test_the_examples_dashboard_and_alerts_use_metrics_that_exist(queue: Queue) -> None:
    from asyncjobq import metrics

    c = metrics.collector(queue)
    # Every series a scrape can show, histograms' _bucket/_count/_sum and counters' _total.
    c.finished.labels("q", "t", "done").inc()
    c.duration.labels("q", "t").observe(1)
    c.pickup.labels("q").observe(1)
    c.claimed.labels("q").inc()
    c.running.labels("q").set(0)
    c.depth.labels("q", "queued").set(0)
    c.flush.observe(0.1)
    exported = {s.name for family in c.collect() for s in family.samples}
    folder = Path(__file__).parent.parent / "examples" / "observability"
    for name in ("grafana-dashboard.json", "alerts.yml"):
        used = set(re.findall(r"asyncjobq_[a-z_]+", (folder / name).read_text()))
        assert used, name
        assert used <= exported, (name, used - exported)
    dashboard = json.loads((folder / "grafana-dashboard.json").read_text())
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for needed in ("throughput by outcome", "pickup latency", "queue depth", "failures"):
        assert needed in titles
