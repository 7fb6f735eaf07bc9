"""A FastAPI service that enqueues a job in the transaction that writes its order.

Serve it with any ASGI server (`uvicorn examples.fastapi_app:app`) and run its jobs with
`python -m asyncjobq worker examples.fastapi_app:queue`.
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

from fastapi import FastAPI
from pydantic import BaseModel

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


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with queue:                    # opens the pool; closes it at shutdown
        await queue.install()            # idempotent; or `python -m asyncjobq install`
        async with queue.connection() as conn:
            await conn.execute(ORDERS)   # your migrations' job; here so that the example runs
        yield


app = FastAPI(lifespan=lifespan)


class Order(BaseModel):
    total: Decimal


@app.post("/orders")
async def create_order(order: Order) -> dict[str, int]:
    async with queue.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO orders (total) VALUES (%s) RETURNING id",
                                 (order.total,))
        row = await cur.fetchone()
        assert row is not None                       # RETURNING gives one row
        order_id = row[0]
        await send_receipt.enqueue({"order_id": order_id}, conn=conn)  # same transaction
    return {"id": order_id}
