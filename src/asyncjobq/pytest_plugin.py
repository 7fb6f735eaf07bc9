"""The pytest plugin (entry point `pytest11`, so pytest loads it by itself once asyncjobq is
installed): a PostgreSQL for the session and `asyncjobq_isolated`, a throwaway schema per test.

    @pytest_asyncio.fixture
    async def queue(asyncjobq_isolated):
        async with asyncjobq_isolated(app.queue) as q:
            yield q

The server is $ASYNCJOBQ_TEST_DSN, else an embedded PostgreSQL (asyncjobq[embedded]) started in
a temporary directory for the session and deleted after it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from .errors import EmbeddedUnavailableError
from .queue import Queue
from .testing import TEST_DSN_ENV, isolated

Isolate = Callable[..., AbstractAsyncContextManager[Queue]]


@pytest.fixture(scope="session")
def asyncjobq_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's PostgreSQL: $ASYNCJOBQ_TEST_DSN, else an embedded one of its own."""
    dsn = os.environ.get(TEST_DSN_ENV)
    if dsn:
        yield dsn
        return
    server = _start_embedded(tmp_path_factory.mktemp("asyncjobq-pg") / "data")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


def _start_embedded(pgdata: Any) -> Any:
    try:
        from ._db.embedded import start_pgserver

        # Deleted at the end: a test server's data is never worth keeping.
        return start_pgserver(pgdata, cleanup_mode="delete")
    except ImportError:
        raise EmbeddedUnavailableError(
            f"the asyncjobq_isolated fixture needs a PostgreSQL: set ${TEST_DSN_ENV} (e.g. "
            "postgresql://postgres@127.0.0.1:5432/postgres), or pip install "
            "'asyncjobq[embedded]' for an embedded one") from None


@pytest.fixture
def asyncjobq_isolated(asyncjobq_dsn: str) -> Isolate:
    """`asyncjobq_isolated(queue)`: `asyncjobq.testing.isolated` on the session's server, an
    async context manager binding `queue` to a fresh installed schema, dropped at its end."""
    return functools.partial(isolated, dsn=asyncjobq_dsn)
