"""The example app's test set-up: each test gets the app's own queue on a throwaway schema.

`asyncjobq_isolated` comes from asyncjobq's pytest plugin, which pytest loads by itself; the
server is $ASYNCJOBQ_TEST_DSN, else an embedded PostgreSQL started for the session.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import pytest_asyncio
import starlette_app

from asyncjobq import Queue


# The test's own event loop: a queue's pool belongs to the loop that opened it.
@pytest_asyncio.fixture(loop_scope="function")
async def queue(
    asyncjobq_isolated: Callable[[Queue], AbstractAsyncContextManager[Queue]],
) -> AsyncIterator[Queue]:
    async with asyncjobq_isolated(starlette_app.queue) as q:   # installed, opened; dropped after
        async with q.connection() as conn:
            await conn.execute(starlette_app.ORDERS)  # lands in the test's schema, dropped too
        yield q
