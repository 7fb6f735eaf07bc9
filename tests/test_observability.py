"""Prometheus metrics and OpenTelemetry traces (issue 20)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fed_collector, fetchval, run_cli, running, spawn_worker, wait_for
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.util._once import Once
from prometheus_client.parser import text_string_to_metric_families

from asyncjobq import Fail, Job, Queue, Worker
from asyncjobq import tracing as jobq_tracing
from asyncjobq.errors import (
    ConfigurationError,
    MetricsPortInUseError,
    SchemaNotInstalledError,
)

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


@pytest.mark.processes
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


@pytest.mark.processes
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

    c = fed_collector(queue)
    # Every series a scrape can show, histograms' _bucket/_count/_sum and counters' _total.
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


# --- what a hostile or unlucky deployment does to them ---------------------------------------

async def test_a_slow_hook_neither_delays_nor_drops_the_counts(queue: Queue) -> None:
    """The collector observes inline: a hook registered before it that hangs does not hold
    the count back until the hooks' timeout."""
    from asyncjobq import metrics

    class Slow:
        async def on_finished(self, **kw: object) -> None:
            await asyncio.sleep(60)

    queue.add_hook(Slow())
    c = metrics.collector(queue)

    @queue.task(name="t")
    async def t(job: Job) -> None:
        pass

    job_id = await queue.enqueue("t", {})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: _status(queue, job_id, "done"), 20, what="the job done")
        # The hooks' timeout is 10 s: counted through the hook pipeline, it would wait so long.
        await wait_for(lambda: c.value("asyncjobq_jobs_finished_total", queue="default",
                                       task="t", outcome="done") == 1,
                       3, what="the finish counted while the slow hook still runs")
        assert c.value("asyncjobq_running_jobs", queue="default") == 0


async def _status(queue: Queue, job_id: int, status: str) -> bool:
    info = await queue.get(job_id)
    return info is not None and info.status == status


async def test_jobs_the_reaper_takes_back_are_counted(queue: Queue) -> None:
    from asyncjobq import metrics

    c = metrics.collector(queue)
    for attempts in (1, 3):  # requeued, and failed with its attempts spent
        await fetchval(queue, "INSERT INTO {s}.jobs (task, queue, payload, status, attempts,"
                       " max_attempts, locked_by, locked_at) VALUES ('gone', 'elsewhere', '{{}}',"
                       " 'running', %s, 3, 'dead', now() - interval '1 hour') RETURNING id",
                       attempts)
    async with running(Worker(queue, poll_interval=0.1, reap_interval=0.1)):
        await wait_for(lambda: all(
            c.value("asyncjobq_jobs_reaped_total", queue="elsewhere", task="gone",
                    result=result) == 1 for result in ("failed", "requeued")),
            20, what="both reaped jobs counted")


async def test_the_depth_of_a_stopped_worker_is_not_left_behind(queue: Queue) -> None:
    """An app serving its own registry keeps serving after its worker stops: the last sampled
    depth must not go on looking current."""
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncjobq import metrics

    registry = CollectorRegistry()
    registry.register(metrics.collector(queue))
    await queue.enqueue_many("nobody", [{}] * 7, queue="q1")
    async with running(Worker(queue, queues="other", poll_interval=0.1, metrics_interval=0.2)):
        await wait_for(lambda: b'asyncjobq_queue_jobs{queue="q1",status="queued"} 7.0'
                       in generate_latest(registry), 10, what="the depth sampled")
        assert b"asyncjobq_queue_jobs_sampled_timestamp_seconds 0.0" not in \
            generate_latest(registry)
    assert b"asyncjobq_queue_jobs{" not in generate_latest(registry)


@pytest.mark.parametrize("setting", [{"metrics_interval": float("nan")},
                                     {"metrics_interval": float("inf")},
                                     {"metrics_interval": 1e-9},
                                     {"lease": float("nan")},
                                     {"poll_interval": float("inf")},
                                     {"metrics_host": ""}])
def test_settings_that_would_storm_or_stall_are_refused(queue: Queue,
                                                        setting: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError) as e:
        Worker(queue, **setting)  # type: ignore[arg-type]
    assert next(iter(setting)) in str(e.value)


def test_a_collector_for_something_that_is_not_a_queue_says_so() -> None:
    from asyncjobq import metrics

    for wrong in (None, "myqueue"):
        with pytest.raises(ConfigurationError, match=r"pass the asyncjobq\.Queue"):
            metrics.collector(wrong)  # type: ignore[arg-type]


async def test_the_metrics_address_can_be_kept_to_this_host(queue: Queue) -> None:
    w = Worker(queue, poll_interval=0.1, metrics_port=0, metrics_host="127.0.0.1")
    async with running(w):
        await wait_for(lambda: w.metrics_server is not None, 10, what="the metrics server")
        assert w.metrics_server is not None and w.metrics_server.host == "127.0.0.1"
        assert "asyncjobq_leader" in str(scrape(w.metrics_server.port))


@pytest.mark.parametrize("context", ['{"traceparent": 5}', "[1, 2]", '"00-abc"',
                                     '{"traceparent": "garbage"}'])
async def test_a_hostile_trace_context_never_fails_its_job(
        queue: Queue, exporter: InMemorySpanExporter, context: str) -> None:
    """trace_context is plain jsonb any SQL may write: what cannot be read starts a new trace."""
    job_id = await fetchval(queue, "INSERT INTO {s}.jobs (task, payload, trace_context)"
                            " VALUES ('t', '{{}}', %s::jsonb) RETURNING id", context)
    ran: list[int] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        ran.append(job.id)

    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: _status(queue, job_id, "done"), 20, what="the job done")
    assert ran == [job_id]
    (span,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    assert span.parent is None


async def test_tracing_on_a_schema_not_yet_migrated_says_to_install(
        queue: Queue, exporter: InMemorySpanExporter) -> None:
    from psycopg import sql as pgsql

    async with queue.connection() as conn:
        await conn.execute(pgsql.SQL("ALTER TABLE {}.jobs DROP COLUMN trace_context")
                           .format(pgsql.Identifier(queue.schema)))
    for enqueue in (lambda: queue.enqueue("t", {}), lambda: queue.enqueue_many("t", [{}]),
                    lambda: queue.enqueue("t", {}, dedup_key="k")):
        with pytest.raises(SchemaNotInstalledError, match="asyncjobq install"):
            await enqueue()


async def test_a_released_attempt_is_not_an_error_span_and_a_timeout_is(
        queue: Queue, exporter: InMemorySpanExporter) -> None:
    started = asyncio.Event()

    @queue.task(name="slow", timeout=0.2, max_attempts=1)
    async def slow(job: Job) -> None:
        await asyncio.sleep(60)

    @queue.task(name="long")
    async def long(job: Job) -> None:
        started.set()
        await asyncio.sleep(60)

    timed = await queue.enqueue("slow", {})
    await queue.enqueue("long", {})
    w = Worker(queue, poll_interval=0.1, shutdown_timeout=0.0)
    async with running(w):
        await wait_for(lambda: _status(queue, timed, "failed"), 20, what="the timeout")
        await wait_for(started.is_set, 20, what="the second running")
    spans = {s.attributes["messaging.message.id"]: s  # type: ignore[index]
             for s in exporter.get_finished_spans() if s.kind == SpanKind.CONSUMER}
    timeout_span = spans[str(timed)]
    assert timeout_span.status.status_code.name == "ERROR"
    assert timeout_span.attributes is not None
    assert timeout_span.attributes["error.type"] == "timeout"
    (released,) = [s for k, s in spans.items() if k != str(timed)]
    assert released.status.status_code.name == "UNSET"
    assert released.attributes is not None
    assert released.attributes["asyncjobq.interrupted"] == "shutdown"


async def test_drain_traces_as_the_worker_does(queue: Queue,
                                               exporter: InMemorySpanExporter) -> None:
    from asyncjobq.testing import drain

    seen: list[object] = []

    @queue.task(name="t")
    async def t(job: Job) -> None:
        seen.append(job.trace_context)

    await queue.enqueue("t", {})
    assert await drain(queue) == {"done": 1, "retry": 0, "failed": 0, "snoozed": 0}
    (sent,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.PRODUCER]
    (ran,) = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    assert ran.parent is not None and ran.parent.span_id == sent.context.span_id
    assert seen and seen[0] is not None
