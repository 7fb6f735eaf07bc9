"""Errors a user can meet. Each message says what to do, as psycopg's do."""

from __future__ import annotations

from typing import Any


class AsyncJobQError(Exception):
    """Base class of every error asyncjobq raises on purpose."""


class ConfigurationError(AsyncJobQError, ValueError):
    """A bad argument or setting: a schema name, a concurrency, a payload."""


class InvalidPayloadError(ConfigurationError):
    """A payload that is not a JSON object."""


class EmbeddedUnavailableError(AsyncJobQError):
    """No DSN was given and the embedded PostgreSQL (pgserver) is not installed or failed."""


class DatabaseUnavailableError(AsyncJobQError):
    """PostgreSQL could not be reached with the DSN in use."""


class EnqueueConnectionError(DatabaseUnavailableError):
    """An enqueue failed because its connection to PostgreSQL did (docs/guides/enqueueing.md:
    Producers during an outage).

    Attributes:
        may_have_been_written: False when the job cannot exist (no connection was had in
            time, or the transaction holding it was lost with the connection); True when the
            INSERT had been sent: the server may have committed it before the reply was
            lost, so enqueueing again may duplicate it unless a dedup_key is given.
    """

    def __init__(self, message: str, *, may_have_been_written: bool) -> None:
        super().__init__(message)
        self.may_have_been_written = may_have_been_written


class EnqueueRefusedError(AsyncJobQError):
    """PostgreSQL refused an enqueue's INSERT (a read-only server after a failover, a
    statement_timeout, a missing privilege, a constraint of the operator's): nothing was
    written. The psycopg error is the `__cause__`.

    Attributes:
        sqlstate: the server's error code (e.g. "25006" for a read-only server), or None.
    """

    def __init__(self, message: str, *, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class SchemaNotInstalledError(AsyncJobQError):
    """The queue schema does not exist yet, or lacks migrations this asyncjobq needs: run
    install."""


class SchemaVersionError(AsyncJobQError):
    """The schema was installed by a newer asyncjobq than this one."""


class QueueClosedError(AsyncJobQError):
    """The Queue's pool is not open."""


class RetryRaceError(AsyncJobQError):
    """Queue.retry or retry_failed kept meeting new jobs of the same dedup_key (each try
    requeued nothing): call it again once those enqueues settle."""


class AppImportError(AsyncJobQError):
    """The worker's APP (module:attribute) cannot be imported or is not a Queue."""


class JobNotFoundError(AsyncJobQError, LookupError):
    """No job has this id: it never existed, or its history was pruned (retention)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} not found: it never existed, or it finished longer ago "
                         "than the queue's retention and was pruned; check the id")
        self.job_id = job_id


class JobFailedError(AsyncJobQError):
    """`Queue.result` of a job that was dead-lettered (status `failed`).

    Attributes:
        job: its JobInfo.
        error: its last error (the newest attempt's line of `last_error`), or None.
    """

    def __init__(self, job: Any) -> None:
        last = (job.last_error or "").splitlines()
        self.job = job
        self.error: str | None = last[-1] if last else None
        super().__init__(f"job {job.id} ({job.task}) failed after {job.attempts} attempt(s): "
                         f"{self.error or 'no error recorded'}; fix the cause and run "
                         f"`retry {job.id}` (or Queue.retry) to run it again")


class JobCancelledError(AsyncJobQError):
    """`Queue.result` of a job that was cancelled.

    Attributes:
        job: its JobInfo.
    """

    def __init__(self, job: Any) -> None:
        self.job = job
        super().__init__(f"job {job.id} ({job.task}) was cancelled; it has no result: "
                         "enqueue it again to run it")


def reason(e: BaseException) -> str:
    """One line saying why a database call failed, for logs and CLI errors."""
    from psycopg_pool import PoolTimeout

    if isinstance(e, PoolTimeout):
        return ("no database connection became available in time: every pooled connection "
                "may be in use (raise the Queue's pool_max_size, or pass conn= to an enqueue "
                "made while holding queue.connection()), or the server may be refusing new "
                "connections (check max_connections and other clients) or be down")
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if getattr(e, "sqlstate", None) in _POOLED_STATEMENT_ERRORS:
        # psycopg prepared it on one server connection, a pooler ran it on another.
        line += (" (if a transaction-mode pooler such as PgBouncer sits between asyncjobq "
                 "and PostgreSQL, use Queue(..., pooler='transaction'))")
    return line


# 26000 prepared statement "_pg3_0" does not exist, 42P05 ... already exists.
_POOLED_STATEMENT_ERRORS = frozenset({"26000", "42P05"})


def a_or_an(noun: str) -> str:
    """'an int', 'a list': type names in messages read as English."""
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


class MetricsPortInUseError(ConfigurationError):
    """The worker's metrics port is taken by another process."""


class ExtraNotInstalledError(ConfigurationError):
    """An optional feature's package (an extra of asyncjobq) is not installed."""
