"""A worker app with OpenTelemetry's SDK set up before the worker starts: its spans are
written, one JSON object a line, to $ASYNCJOBQ_TEST_SPANS (tests/test_observability.py)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from asyncjobq import Job, Queue


class FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.lock, open(self.path, "a") as f:
            for s in spans:
                ctx = s.get_span_context()
                assert ctx is not None
                f.write(json.dumps({
                    "name": s.name, "kind": s.kind.name,
                    "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                    "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
                    "attributes": dict(s.attributes or {}),
                    "status": s.status.status_code.name,
                    "events": [e.name for e in s.events],
                }) + "\n")
                f.flush()
        return SpanExportResult.SUCCESS


provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["ASYNCJOBQ_TEST_SPANS"])))
trace.set_tracer_provider(provider)

queue = Queue(schema=os.environ.get("ASYNCJOBQ_TEST_SCHEMA", "asyncjobq"))


@queue.task(name="traced", max_attempts=2, backoff=lambda attempt: 0.0)
async def traced(job: Job) -> None:
    # Fails its first attempt when asked: the retry is a second CONSUMER span in the trace.
    if job.payload.get("fail_first") and job.attempt == 1:
        raise RuntimeError("first attempt fails")
    if job.payload.get("fail_always"):
        raise RuntimeError("always fails")
