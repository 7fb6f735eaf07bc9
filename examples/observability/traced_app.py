"""Traces from a web request's enqueue to the worker's handler, exported over OTLP.

    pip install 'asyncjobq[otel,prometheus]' opentelemetry-sdk \
        opentelemetry-exporter-otlp-proto-http
    # a collector or Jaeger listening on OTLP/HTTP (default http://localhost:4318):
    docker run --rm -p 16686:16686 -p 4318:4318 jaegertracing/all-in-one
    python -m asyncjobq worker examples.observability.traced_app:queue --metrics-port 9464
    python -m examples.observability.traced_app          # enqueues inside a "checkout" span

The tracer provider is set when this module is imported, so before the worker starts: the
worker then runs each handler in a `process <queue>` span whose parent is the `send <queue>`
span of the enqueue, read from the job's row. Set OTEL_EXPORTER_OTLP_ENDPOINT to send
elsewhere.
"""

from __future__ import annotations

import asyncio
import os

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import asyncjobq

provider = TracerProvider(resource=Resource.create({"service.name": "shop"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)

queue = asyncjobq.Queue(schema=os.environ.get("QUEUE_SCHEMA", "asyncjobq"))


@queue.task(name="send_receipt", max_attempts=3)
async def send_receipt(job: asyncjobq.Job) -> None:
    # Spans made here are children of the handler's CONSUMER span.
    with trace.get_tracer("shop").start_as_current_span("render receipt"):
        await asyncio.sleep(0.01)
    if job.attempt == 1 and job.payload.get("flaky"):
        raise RuntimeError("mail server busy")  # recorded on the span; the retry is a new one


async def main() -> None:
    async with queue:
        await queue.install()
        with trace.get_tracer("shop").start_as_current_span("checkout"):
            await queue.enqueue("send_receipt", {"order": 1})
            await queue.enqueue_many("send_receipt", [{"order": 2}, {"order": 3, "flaky": True}])
    provider.shutdown()  # flushes the batch of spans


if __name__ == "__main__":
    asyncio.run(main())
