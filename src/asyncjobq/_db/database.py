"""One queue schema in one PostgreSQL: its DSN, its pool and its named statements.

Everything below the public API (the worker machinery, the maintenance services) reaches the
database through a Database, handed to it by Queue or Worker, never through the Queue itself
(docs/how-it-works/architecture.md).
"""

from __future__ import annotations

import logging
import math
import select
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import psycopg.errors
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff

from ..errors import (
    ConfigurationError,
    DatabaseUnavailableError,
    QueueClosedError,
    SchemaNotInstalledError,
    reason,
)
from .dsn import redact, resolve_dsn
from .sql import Statements, statements

log = logging.getLogger("asyncjobq.database")
Conn = AsyncConnection[Any]
NOT_OPEN = "the queue is not open: use `async with queue:` or `await queue.open()` first"
# Longest wait between two attempts to replace a lost pooled connection: enqueues resume at
# most this long after the server is back.
RECONNECT_INTERVAL = 0.5
# How long a checkout waits for a pooled connection (psycopg_pool's default).
POOL_TIMEOUT = 30.0
# A server that vanished without closing the socket (a failover to another host, a dropped
# NAT entry) answers nothing, and the check on checkout sees nothing to read: without these, a
# statement sent on such a connection waits for the kernel's retransmission timeout (~15 min).
# Data unacknowledged for TCP_USER_TIMEOUT ms, or an idle connection whose probes go
# unanswered for KEEPALIVES_IDLE + 3 * 2 s, ends the connection with an error instead.
TCP_USER_TIMEOUT = 10_000
KEEPALIVES_IDLE = 10
TCP_OPTIONS = {"keepalives": 1, "keepalives_idle": KEEPALIVES_IDLE, "keepalives_interval": 2,
               "keepalives_count": 3, "tcp_user_timeout": TCP_USER_TIMEOUT}


class OncePerInterval(logging.Filter):
    """psycopg_pool warns once per dead connection it discards: when the server ends every
    backend, that is one line per connection per outage (hundreds a second in a
    pg_terminate_backend storm), while asyncjobq's own parts already say what was lost and what
    they do about it. One such line per interval, with the count of the ones held back."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self.last = -interval
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("discarding closed connection"):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{record.msg} (and {self.held} more in the last {self.interval:g} s)"
        self.last, self.held = now, 0
        return True


# The longest statement text psycopg keeps parsed. Past its own limit (4,096 bytes,
# psycopg/_queries.py MAX_CACHED_STATEMENT_LENGTH, a guard against ORMs' ever-different long
# queries) it parses a text for its placeholders at every execute: 22 us for a worker's
# flush-and-claim of 4.4 kB (a long schema name, several queues or flow limits make it
# longer), a few per cent of a worker's CPU. A worker's statements are few and fixed.
LONGEST_CACHED_STATEMENT = 16384


def cache_long_statements() -> None:
    """Let psycopg keep the worker's long statements parsed (see LONGEST_CACHED_STATEMENT).
    Process-wide: a worker calls it as it starts. Without the setting (another psycopg),
    statements are parsed as psycopg does, only slower."""
    from psycopg import _queries

    if getattr(_queries, "MAX_CACHED_STATEMENT_LENGTH", None) is not None:
        _queries.MAX_CACHED_STATEMENT_LENGTH = max(
            _queries.MAX_CACHED_STATEMENT_LENGTH, LONGEST_CACHED_STATEMENT)


def _quiet_pool_discards() -> None:
    pool_log = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, OncePerInterval) for f in pool_log.filters):
        pool_log.addFilter(OncePerInterval())


class _Reconnect(AttemptWithBackoff):
    """psycopg_pool's reconnection schedule, every RECONNECT_INTERVAL (+-10 %) instead of
    doubling from 1 s without a cap (attempts at +0, +1, +3, +7, +15 s...: after an outage of
    T seconds, the pool's next attempt could come T seconds after the server was back)."""

    INITIAL_DELAY = RECONNECT_INTERVAL
    DELAY_BACKOFF = 1.0


class _Pool(AsyncConnectionPool[Conn]):
    """The pool, reconnecting on _Reconnect's schedule.

    psycopg_pool has no parameter for how often it retries, only for how long
    (reconnect_timeout, which also ends the retries of a pool slot for good), so the one
    hook is the private method that makes a new attempt; its signature is the same from
    psycopg-pool 3.2.1 to 3.3. A slot still gives up after reconnect_timeout (5 min), as
    before; a client's checkout then starts a new attempt.
    """

    async def _add_connection(self, attempt: AttemptWithBackoff | None,
                              growing: bool = False) -> None:
        if attempt is None:
            attempt = _Reconnect(timeout=self.reconnect_timeout)
        await super()._add_connection(attempt, growing=growing)


class Database:
    def __init__(self, dsn: str | None, *, schema: str, pool_min_size: int, pool_max_size: int,
                 connect_timeout: float, application_name: str) -> None:
        self.schema = schema
        # What sits between us and PostgreSQL (docs/guides/deploying.md, "Behind PgBouncer"):
        # "auto" finds out at open(); `pooled` is then True behind a pooler, and nothing is
        # left on a server connection between two transactions.
        self.pooler = "auto"
        self.pooled = False
        self._listen_dsn: str | None = None
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
    def done_channel(self) -> str:
        """The channel on which statements that make a job final name the jobs a
        `Queue.wait` looks for (0011_results.sql)."""
        return f"{self.schema}_done"

    @property
    def generation_channel(self) -> str:
        """The channel on which the leader's rotation names the generation of jobs it made
        current (0013_generations.sql); workers listen on it."""
        return f"{self.schema}_gen"

    @property
    def cancel_channel(self) -> str:
        """The channel on which `Queue.cancel` names running jobs whose cancel it asked for;
        workers listen on it."""
        return f"{self.schema}_cancel"

    @property
    def listen_dsn(self) -> str | None:
        """Where LISTEN connections go: `listen_dsn` when given, else the DSN itself,
        except behind a transaction pooler, where there is none (None: poll instead)."""
        if self._listen_dsn:
            return self._listen_dsn
        return None if self.pooled else self.dsn

    def connect_options(self, **tcp: int) -> dict[str, Any]:
        """Options of every connection the library opens to `dsn` (beside its DSN): the TCP
        settings above (or `tcp`'s, for a connection with a bound of its own), so that a
        server gone silent ends the connection with an error.

        Behind a transaction pooler, psycopg must not prepare statements: a statement
        prepared on one server connection is unknown on the next one the pooler hands out
        (PgBouncer before 1.21 has no prepared statements of its own)."""
        options: dict[str, Any] = {**TCP_OPTIONS, **tcp}
        if self.pooled:
            options["prepare_threshold"] = None
        return options

    @property
    def dsn(self) -> str:
        """The DSN in use (resolved on first use: argument, $ASYNCJOBQ_DSN, embedded)."""
        if self._dsn is None:
            self._dsn = resolve_dsn(self._dsn_arg)
        return self._dsn

    def set_pooler(self, pooler: str | None, listen_dsn: str | None) -> None:
        if self._pool is not None:
            raise ConfigurationError("set_pooler() on an open queue: close it first")
        if pooler is not None:
            self.pooler = pooler
            self.pooled = pooler == "transaction"
        if listen_dsn is not None:
            self._listen_dsn = listen_dsn

    def set_dsn(self, dsn: str | None) -> None:
        if self._pool is not None:
            raise ConfigurationError("set_dsn() on an open queue: close it first")
        self._dsn_arg = dsn
        self._dsn = None
        if self._listen_dsn:
            # Given for the old DSN, it would LISTEN to the old database.
            log.warning("listen_dsn %s is not used with the DSN %s given now: give a "
                        "listen_dsn for it too (the worker's --listen-dsn), or workers behind "
                        "a pooler poll", redact(self._listen_dsn), dsn and redact(dsn))
            self._listen_dsn = None

    def rebind(self, dsn: str | None,
               schema: str) -> tuple[str | None, str | None, str, str | None]:
        """Point a closed Database at another DSN and schema; returns what to pass to
        `restore` to point it back as it was."""
        if self._pool is not None:
            raise ConfigurationError("rebinding an open queue: close it first")
        before = (self._dsn_arg, self._dsn, self.schema, self._listen_dsn)
        self._dsn_arg, self._dsn, self.schema = dsn, None, schema
        self._listen_dsn = None  # it listened to the other database
        self.sql = statements(schema)
        return before

    def restore(self, binding: tuple[str | None, str | None, str, str | None]) -> None:
        if self._pool is not None:
            raise ConfigurationError("restoring an open queue: close it first")
        self._dsn_arg, self._dsn, self.schema, self._listen_dsn = binding
        self.sql = statements(self.schema)

    def sql_of(self, gen: int | None, outcomes: int = 0) -> Statements:
        """The statements whose claims and completions name generation `gen`'s partition
        (None: jobs, every partition), with the worker's flush for `outcomes`
        (sql/claim.py: ANY_OUTCOMES, PLAIN_OUTCOMES, DONE_OUTCOMES, LOCKED_DONE_OUTCOMES)."""
        return statements(self.schema, outcomes, gen)

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
            pooled, database, _ = await self._probe(dsn, self.application_name)
        except psycopg.OperationalError as e:
            raise DatabaseUnavailableError(
                f"cannot connect to PostgreSQL at {redact(dsn)}: {reason(e)}; check that "
                "the server is running and the DSN is right (--dsn or $ASYNCJOBQ_DSN)"
            ) from None
        if self.pooler == "auto":
            self.pooled = pooled
            if pooled:
                log.log(
                    logging.INFO if self._listen_dsn else logging.WARNING,
                    "a connection pooler sits between asyncjobq and PostgreSQL at %s: no "
                    "prepared statements, session settings or LISTEN through it%s (say "
                    "Queue(pooler='session') if it pools sessions, not transactions)",
                    redact(dsn), "" if self._listen_dsn else
                    "; workers poll (give listen_dsn= a direct connection to wake them at once)")
        if self._listen_dsn:
            await self._check_listen_dsn(database)
        lo, hi = self.pool_sizes
        options = self.connect_options()
        pool = _Pool(
            dsn,
            min_size=lo,
            max_size=hi,
            # connect_timeout: an attempt to a host that does not answer (no refusal either)
            # holds one of the pool's few maintenance workers; bound it.
            kwargs={"autocommit": True, "application_name": self.application_name,
                    "connect_timeout": max(1, math.ceil(self.connect_timeout)), **options},
            open=False,
            # No check= here: connection() checks (see there), without the pool's pause.
            name=f"asyncjobq-{self.schema}",
            timeout=POOL_TIMEOUT,
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
        _quiet_pool_discards()

    async def _probe(self, dsn: str, application_name: str) -> tuple[bool, str, bool]:
        """One connection to `dsn`, closed at once: server_of() it."""
        # libpq reads connect_timeout=0 as "wait for ever": round a fraction up.
        conn = await AsyncConnection.connect(
            dsn, autocommit=True, prepare_threshold=None, application_name=application_name,
            connect_timeout=max(1, math.ceil(self.connect_timeout)))
        try:
            return await server_of(conn)
        finally:
            await conn.close()

    async def _check_listen_dsn(self, database: str) -> None:
        """listen_dsn must reach the queue's own database, directly: through a pooler LISTEN
        hears nothing, and elsewhere it hears another database's notifications, while the
        worker, trusting them, would claim from floors they no longer lower."""
        assert self._listen_dsn is not None
        where = redact(self._listen_dsn)
        try:
            pooled, listened, standby = await self._probe(self._listen_dsn,
                                                          f"{self.application_name}-listen")
        except psycopg.OperationalError as e:
            raise DatabaseUnavailableError(
                f"cannot connect to PostgreSQL at listen_dsn {where}: {reason(e)}; check "
                "that it reaches the queue's PostgreSQL directly (not through the pooler)"
            ) from None
        if pooled:
            raise ConfigurationError(
                f"listen_dsn {where} goes through a connection pooler, where LISTEN hears "
                "nothing: point it at PostgreSQL itself (or leave it out: workers then poll)")
        if standby:
            raise ConfigurationError(
                f"listen_dsn {where} reaches a standby, which cannot LISTEN: point it at the "
                "primary (a multi-host listen_dsn with target_session_attrs=read-write)")
        if listened != database:
            raise ConfigurationError(
                f"listen_dsn {where} reaches database {listened!r}, the queue's DSN "
                f"{database!r}: point both at the same database")

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
    async def connection(self, timeout: float | None = None) -> AsyncIterator[Conn]:
        """A pooled autocommit connection, waiting up to `timeout` seconds (default
        POOL_TIMEOUT) for one; PoolTimeout after that.

        Each connection is checked before use (check_idle_connection); one the server has
        ended is handed back, which makes the pool replace it, and the next one is taken at
        once. psycopg_pool's own check= pauses 1 s, then 2, 4, 8 s... between connections that
        fail it: after a restart, a pool holding a few dead idle connections made the first
        checkout wait seconds for the server that was already back.
        """
        pool = self.pool
        deadline = time.monotonic() + (POOL_TIMEOUT if timeout is None else timeout)
        while True:
            conn = await pool.getconn(timeout=max(0.0, deadline - time.monotonic()))
            try:
                await check_idle_connection(conn)
            except psycopg.Error:
                # Closed, the pool discards it and connects anew instead of handing it out.
                await conn.close()
                await pool.putconn(conn)
                continue
            except BaseException:
                await pool.putconn(conn)
                raise
            break
        try:
            async with conn:  # as pool.connection() does: commit, or roll back on error
                yield conn
        finally:
            await pool.putconn(conn)

    @contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Turn 'schema or table missing' into an error that says to run install."""
        try:
            yield
        except psycopg.errors.UndefinedColumn as e:
            # Our statements name only our columns: the schema predates a migration (one
            # that adds a column, as 0005 adds trace_context for producers that trace).
            raise SchemaNotInstalledError(
                f"schema {self.schema} is older than this asyncjobq ({reason(e)}): run "
                "`python -m asyncjobq install` (or `await queue.install()`) to migrate it"
            ) from None
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName,
                psycopg.errors.UndefinedObject) as e:
            # A table of a later migration (an enqueue names `generation`, version 13) is
            # missing from an older schema as well as from none.
            raise SchemaNotInstalledError(
                f"schema {self.schema} is not installed, or older than this asyncjobq "
                f"({reason(e)}): run `python -m asyncjobq install` (or `await queue.install()`)"
            ) from None


async def server_of(conn: Conn) -> tuple[bool, str, bool]:
    """Whether a pooler stands between this connection and PostgreSQL, the database, and
    whether the server is a standby.

    A server sends the client its process id as the connection starts (BackendKeyData, for
    cancel requests); a pooler cannot hand out a server's, since the client's session is not
    tied to one server connection, and sends one of its own (PgBouncer, Odyssey, pgcat,
    Supavisor): the id the client was given then differs from the backend's own."""
    cur = await conn.execute("SELECT pg_backend_pid(), current_database(), pg_is_in_recovery()")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0]) != conn.info.backend_pid, str(row[1]), bool(row[2])


async def check_idle_connection(conn: Conn) -> None:
    """The check on checkout (Database.connection), without a round trip for a connection
    that looks alive.

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
