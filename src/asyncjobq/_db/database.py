"""One queue schema in one PostgreSQL: its DSN, its pool and its named statements.

Everything below the public API (the worker machinery, the maintenance services) reaches the
database through a Database, handed to it by Queue or Worker, never through the Queue itself
(docs/architecture.md).
"""

from __future__ import annotations

import select
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from ..errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    QueueClosedError,
    SchemaNotInstalledError,
    reason,
)
from .dsn import redact, resolve_dsn
from .sql import Statements, statements

Conn = AsyncConnection[Any]
NOT_OPEN = "the queue is not open: use `async with queue:` or `await queue.open()` first"


class Database:
    def __init__(self, dsn: str | None, *, schema: str, pool_min_size: int, pool_max_size: int,
                 connect_timeout: float, application_name: str) -> None:
        self.schema = schema
        self.sql: Statements = statements(schema)
        self._dsn_arg = dsn
        self._dsn: str | None = None
        self.pool_sizes = (pool_min_size, pool_max_size)
        self.connect_timeout = connect_timeout
        # Shown in pg_stat_activity; the worker's own connections append -listen, -heartbeat.
        self.application_name = application_name
        self._pool: AsyncConnectionPool[Conn] | None = None

    def where(self) -> str:
        """The DSN for messages, password removed; 'unresolved' before first use."""
        where = redact(self._dsn) if self._dsn else (self._dsn_arg and redact(self._dsn_arg))
        return where or "unresolved"

    @property
    def channel(self) -> str:
        """The NOTIFY channel the jobs table's insert trigger signals."""
        return f"{self.schema}_jobs"

    @property
    def dsn(self) -> str:
        """The DSN in use (resolved on first use: argument, $ASYNCJOBQ_DSN, embedded)."""
        if self._dsn is None:
            self._dsn = resolve_dsn(self._dsn_arg)
        return self._dsn

    def set_dsn(self, dsn: str | None) -> None:
        if self._pool is not None:
            raise ConfigurationError("set_dsn() on an open queue: close it first")
        self._dsn_arg = dsn
        self._dsn = None

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    async def open(self) -> None:
        if self._pool is not None:
            return
        dsn = self.dsn
        # One direct attempt first: an unreachable server fails in seconds with the driver's
        # reason, instead of a pool timeout that hides it.
        try:
            probe = await AsyncConnection.connect(
                dsn, connect_timeout=int(self.connect_timeout),
                application_name=self.application_name)
            await probe.close()
        except psycopg.OperationalError as e:
            raise DatabaseUnavailableError(
                f"cannot connect to PostgreSQL at {redact(dsn)}: {reason(e)}; check that "
                "the server is running and the DSN is right (--dsn or $ASYNCJOBQ_DSN)"
            ) from None
        lo, hi = self.pool_sizes
        pool: AsyncConnectionPool[Conn] = AsyncConnectionPool(
            dsn,
            min_size=lo,
            max_size=hi,
            kwargs={"autocommit": True, "application_name": self.application_name},
            open=False,
            check=check_idle_connection,
            name=f"asyncjobq-{self.schema}",
            timeout=30.0,
        )
        try:
            await pool.open(wait=True, timeout=self.connect_timeout)
        except PoolTimeout:
            await pool.close()
            raise DatabaseUnavailableError(
                f"cannot open {lo} connection(s) to {redact(dsn)} within "
                f"{self.connect_timeout} s: check max_connections and the server's load"
            ) from None
        self._pool = pool

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    @property
    def pool(self) -> AsyncConnectionPool[Conn]:
        if self._pool is None:
            raise QueueClosedError(NOT_OPEN)
        return self._pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A pooled autocommit connection."""
        async with self.pool.connection() as conn:
            yield conn

    @contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Turn 'schema or table missing' into an error that says to run install."""
        try:
            yield
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName,
                psycopg.errors.UndefinedObject) as e:
            raise SchemaNotInstalledError(
                f"schema {self.schema} is not installed ({reason(e)}): run "
                "`python -m asyncjobq install` (or `await queue.install()`)"
            ) from None


async def check_idle_connection(conn: Conn) -> None:
    """The pool's check on checkout, without a round trip for a connection that looks alive.

    psycopg_pool's check_connection sends an empty query on every checkout: one enqueue()
    became two round trips (measured: 30-40 % of the concurrent enqueue rate). An idle
    connection has nothing to read; when the server has ended it (restart, terminated
    backend, crash) the socket turns readable with the server's FATAL message or EOF, and
    only then is the round trip made, which raises and makes the pool replace it.
    """
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    if not hasattr(select, "poll"):  # Windows
        await AsyncConnectionPool.check_connection(conn)
        return
    # poll(), not select(): select() refuses descriptors past 1024, which busy services reach.
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    if poller.poll(0):
        await AsyncConnectionPool.check_connection(conn)


def storable(text: str) -> bool:
    """Whether PostgreSQL text can hold it: no NUL, and valid UTF-8 (no lone surrogates)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
