"""OpenTelemetry traces from enqueue to handler (docs/guides/observability.md; extra
`asyncjobq[otel]`).

With `opentelemetry-api` installed and a tracer provider configured (the application sets up
the SDK and its exporter, before the worker starts), `enqueue` and `enqueue_many` record a
PRODUCER span (`send <queue>`; one span for a batch, with its count) and store its W3C trace
context with the job; the worker runs each attempt of the handler in a CONSUMER span
(`process <queue>`) whose parent is that context, so the trace crosses processes in the job's
row, never in memory. A retry is a new CONSUMER span under the same producer span. Attributes
follow the messaging semantic conventions.

Without the package, or with no provider configured, `producer()` returns None after one
check, nothing is stored (the column stays NULL) and the worker adds no middleware.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .job import Job, Retry

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import (
        NoOpTracerProvider,
        ProxyTracerProvider,
        SpanKind,
        Status,
        StatusCode,
    )
except ImportError:  # the otel extra is not installed: tracing stays off
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

#: The `messaging.system` attribute of every span.
SYSTEM = "asyncjobq"
# Why the worker cancels a handler (executor.RunningJob.cancel): the job is released or let go,
# which is not the handler's failure. A timeout's cancellation carries no message.
_RELEASED = ("shutdown", "lease lost")

log = logging.getLogger("asyncjobq.tracing")
_warned_context = False


def enabled() -> bool:
    """Whether spans would be recorded: the API is installed and a real tracer provider is
    set (the API's default is a proxy that records nothing)."""
    if trace is None:
        return False
    return not isinstance(trace.get_tracer_provider(),
                          ProxyTracerProvider | NoOpTracerProvider)


def _tracer() -> Tracer:
    return trace.get_tracer("asyncjobq")


class ProducerSpan:
    """The span of one enqueue (or one enqueue_many), current while the jobs are written."""

    def __init__(self, task: str, queue: str, count: int | None) -> None:
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send",
            "messaging.operation.name": "enqueue" if count is None else "enqueue_many",
            "messaging.destination.name": queue,
            "asyncjobq.task": task,
        }
        if count is not None:
            attributes["messaging.batch.message_count"] = count
        self.span: Span = _tracer().start_span(f"send {queue}", kind=SpanKind.PRODUCER,
                                               attributes=attributes)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        # Stored as the job's trace_context (jsonb): traceparent, and tracestate if any.
        self.context = json.dumps(carrier, separators=(",", ":"))
        self._use = trace.use_span(self.span, end_on_exit=True, record_exception=True,
                                   set_status_on_exception=True)

    def __enter__(self) -> ProducerSpan:
        self._use.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._use.__exit__(*exc)

    def written(self, ids: list[int]) -> None:
        """Record the job's id (`messaging.message.id`) when the enqueue wrote one job."""
        if len(ids) == 1:
            self.span.set_attribute("messaging.message.id", str(ids[0]))


def producer(task: str, queue: str, count: int | None = None) -> ProducerSpan | None:
    """The PRODUCER span of an enqueue (count=None) or of a batch of `count` jobs; None when
    tracing is off."""
    if not enabled():
        return None
    return ProducerSpan(task, queue, count)


def _parent(job: Job) -> Any:
    """The enqueue's context from the job's trace_context, or None. The column is plain jsonb
    that any SQL may write: a value that is not a carrier of strings starts a new trace and
    never fails the job."""
    global _warned_context
    carrier = job.trace_context
    if not carrier:
        return None
    try:
        if not isinstance(carrier, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in carrier.items()):
            raise TypeError("not a JSON object of strings")
        return propagate.extract(carrier)
    except Exception as e:
        if not _warned_context:
            _warned_context = True
            log.warning("job %s (%s): its trace_context %.200r cannot be read (%s); its span "
                        "starts a new trace (written by SQL? store W3C traceparent/tracestate "
                        "strings, or NULL); logged once", job.id, job.task, carrier, e)
        return None


async def consume(job: Job, call_next: Callable[[Job], Awaitable[object]]) -> object:
    """Middleware: the handler's attempt in a CONSUMER span, child of the enqueue's span."""
    parent = _parent(job)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.id),
        "asyncjobq.task": job.task,
        "asyncjobq.attempt": job.attempt,
    }
    with _tracer().start_as_current_span(
            f"process {job.queue}", context=parent, kind=SpanKind.CONSUMER,
            attributes=attributes, record_exception=False,
            set_status_on_exception=False) as span:
        try:
            return await call_next(job)
        except Retry as e:
            # Asked for by the handler, not an error.
            span.set_attribute("asyncjobq.retry_delay", e.delay)
            raise
        except asyncio.CancelledError as e:
            why = e.args[0] if e.args else None
            if why in _RELEASED:
                # Released by the worker (shutdown) or let go (lease lost): not an error.
                span.set_attribute("asyncjobq.interrupted", str(why))
            else:
                span.set_attribute("error.type", "timeout")
                span.set_status(Status(StatusCode.ERROR, "cancelled: the task's timeout "
                                       "(or the handler's own cancellation)"))
            raise
        except BaseException as e:
            span.record_exception(e)
            span.set_attribute("error.type", type(e).__qualname__)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise


def instrument_worker(middleware: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The middleware chain with `consume` outermost (so the span covers the application's
    middleware too), or None when tracing is off or it is there already."""
    if not enabled() or consume in middleware:
        return None
    return (consume, *middleware)
