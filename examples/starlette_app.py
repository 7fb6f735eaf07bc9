"""A Starlette service that enqueues a job in the transaction that writes its order.

Serve it with any ASGI server (`uvicorn examples.starlette_app:app`) and run its jobs with
`python -m asyncjobq worker examples.starlette_app:queue`.
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from psycopg import AsyncConnection
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asyncjobq import Job, Queue

# The DSN is $ASYNCJOBQ_DSN (else an embedded PostgreSQL); the schema is the app's setting.
queue = Queue(schema=os.environ.get("QUEUE_SCHEMA", "asyncjobq"))

ORDERS = """CREATE TABLE IF NOT EXISTS orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    total numeric NOT NULL,
    receipt_sent_at timestamptz)"""


@queue.task(max_attempts=5)
async def send_receipt(job: Job) -> None:
    # ... e-mail the receipt for job.payload["order_id"], then note it (a job may run twice)
    async with queue.connection() as conn:
        await conn.execute("UPDATE orders SET receipt_sent_at = now() WHERE id = %s",
                           (job.payload["order_id"],))
    print(f"receipt sent for order {job.payload['order_id']}", flush=True)


async def place_order(conn: AsyncConnection[Any], total: float) -> int:
    """Write the order and its receipt's job in the caller's transaction."""
    cur = await conn.execute("INSERT INTO orders (total) VALUES (%s) RETURNING id", (total,))
    row = await cur.fetchone()
    assert row is not None                           # RETURNING gives one row
    order_id: int = row[0]
    await send_receipt.enqueue({"order_id": order_id}, conn=conn)  # same transaction
    return order_id


async def create_order(request: Request) -> JSONResponse:
    order = await request.json()
    async with queue.connection() as conn, conn.transaction():
        order_id = await place_order(conn, order["total"])
    return JSONResponse({"id": order_id})


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with queue:                    # opens the pool; closes it at shutdown
        await queue.install()            # idempotent; or `python -m asyncjobq install`
        async with queue.connection() as conn:
            await conn.execute(ORDERS)   # your migrations' job; here so that the example runs
        yield


app = Starlette(routes=[Route("/orders", create_order, methods=["POST"])], lifespan=lifespan)
