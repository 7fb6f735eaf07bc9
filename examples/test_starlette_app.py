"""Tests of examples/starlette_app.py, as an app's own suite would write them: `pytest examples`."""

import httpx
import pytest
from starlette_app import app, place_order, send_receipt

from asyncjobq import Queue
from asyncjobq.testing import assert_enqueued, drain, refute_enqueued

pytestmark = pytest.mark.asyncio


async def test_the_receipt_is_enqueued_in_the_orders_transaction(queue: Queue) -> None:
    async with queue.connection() as conn:
        async with conn.transaction():
            order_id = await place_order(conn, 25)
            # Seen by the transaction that wrote it, by nobody else until it commits.
            await assert_enqueued(queue, send_receipt, {"order_id": order_id}, conn=conn)
            await refute_enqueued(queue, send_receipt)
        await assert_enqueued(queue, send_receipt, {"order_id": order_id})

        async with conn.transaction(force_rollback=True):
            await place_order(conn, 50)
        await refute_enqueued(queue, send_receipt, {"order_id": order_id + 1})


async def test_posting_an_order_sends_its_receipt(queue: Queue) -> None:
    # The fixture opened the queue, so the app's lifespan is not needed here.
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/orders", json={"total": 25})
    order_id = response.json()["id"]
    await assert_enqueued(queue, send_receipt, {"order_id": order_id})

    assert await drain(queue) == {"done": 1, "retry": 0, "failed": 0, "snoozed": 0}
    async with queue.connection() as conn:
        cur = await conn.execute("SELECT receipt_sent_at IS NOT NULL FROM orders")
        assert await cur.fetchall() == [(True,)]
