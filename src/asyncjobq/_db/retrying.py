"""How the worker's loops live through database errors: back off, log each kind once, say what
to do, try again.

A loop that talks to the database (the fetcher, the completer's lanes, the listener, the
maintenance services) meets more than lost connections: a failover leaves it on a read-only
server, an operator revokes a privilege, a statement_timeout on the role cancels a claim waiting
on a lock. None of these is a bug of the loop, and none may end the worker: its outcomes in
memory would be lost with it. So every database error is retried until a statement succeeds;
anything else (a bug) still propagates.
"""

from __future__ import annotations

import logging
import random

import psycopg
from psycopg_pool import PoolTimeout

from ..errors import reason

# Tries of one transaction that PostgreSQL ended as one side of a deadlock, for callers that
# are not loops and give up at last (an install, an enqueue): its rollback was whole, so it is
# safe to run again.
DEADLOCK_TRIES = 3

# What the loops retry. PoolTimeout is an OperationalError, named for the reader.
RETRYABLE: tuple[type[Exception], ...] = (psycopg.Error, PoolTimeout)

_CONNECTION = "retrying until the server is back"
_SCHEMA = ("the queue's schema is missing or older than this asyncjobq: run "
           "`python -m asyncjobq install` (or `await queue.install()`)")
_ADVICE = {
    "25006": "the server is read-only (a standby, or default_transaction_read_only is on): "
             "workers resume when it accepts writes; after a failover, point the DSN at the "
             "new primary",
    "42501": "grant the worker's role USAGE on the queue's schema and SELECT, INSERT, UPDATE, "
             "DELETE on its tables and USAGE on its sequences (GRANT ... TO <role>), or run "
             "workers as the schema's owner",
    "57014": "a statement was cancelled: check statement_timeout for the worker's role and "
             "database (SHOW statement_timeout, connected as that role) and what holds locks "
             "on the queue's tables (pg_locks); pg_cancel_backend() does this too",
    "55P03": "a lock was not granted in time: check lock_timeout for the worker's role and "
             "what holds locks on the queue's tables (pg_locks)",
    "57P01": "the server ended the connection (a shutdown, or pg_terminate_backend); "
             + _CONNECTION,
    "57P02": "the server crashed; " + _CONNECTION,
    "57P03": "the server is starting up or not accepting connections; " + _CONNECTION,
    "42P01": _SCHEMA,
    "3F000": _SCHEMA,
    "42703": _SCHEMA,
    "42883": _SCHEMA,
}
_ADVICE_BY_CLASS = {
    "08": "the connection was lost or refused; " + _CONNECTION,
    "53": "the server is out of a resource (disk, memory or connections): free some; "
          "retrying until it has enough",
    "40": "a transaction conflict; retrying",
}


def kind(e: BaseException) -> str:
    """The kind of a database error, as logged once: its SQLSTATE, else its class."""
    return getattr(e, "sqlstate", None) or type(e).__name__


def advice(e: BaseException) -> str:
    """What to do about a database error, for the operator reading the log."""
    sqlstate = getattr(e, "sqlstate", None)
    if sqlstate:
        return _ADVICE.get(sqlstate) or _ADVICE_BY_CLASS.get(sqlstate[:2]) or "retrying"
    if isinstance(e, PoolTimeout):
        return "retrying"  # reason() says what to check
    # No SQLSTATE: the driver's own error, a connection that failed or closed.
    return "the connection was lost or refused; " + _CONNECTION


class Backoff:
    """A wait that starts at `first` and doubles each time it is taken, never past `most`,
    until `reset()` starts it over: `next()` returns first, 2 * first, 4 * first, ..., most,
    most, ... (`first` itself is capped at `most` too).

    The waits built on it, and their values:

    - a worker loop's database errors (`RetryPolicy`): 0.1 s doubling to 5 s (the completer's
      lanes from 0.05 s, its final flush 0.2 s to 1 s), each wait jittered by +-20 %, reset by
      a success;
    - a failed maintenance turn (services.py): 2, 4, 8, 16, 32 and then 64 times the service's
      interval, at most its `max_backoff` (60 s unless the service says otherwise) but never
      less than one interval; reset by a turn that succeeds;
    - a claim that held rows back for a full limit (the fetcher): 0.1 s (a rate window: 0.02 s)
      doubling to poll_interval, reset by a claim that holds none back.
    """

    def __init__(self, first: float, most: float) -> None:
        self._first = self._next = min(first, most)
        self._most = most

    def next(self) -> float:
        wait, self._next = self._next, min(self._most, 2 * self._next)
        return wait

    def reset(self) -> None:
        self._next = self._first


class RetryPolicy:
    """Backoff and once-per-kind logging for one loop that retries database errors.

    `failed(e)` logs `e` (a warning the first time its kind is met since the last success, a
    debug line after) and returns the seconds to wait; `succeeded()` resets both. Loops that
    do the same work (the completer's lanes) share `seen`, so that they warn once together.
    """

    def __init__(self, log: logging.Logger, doing: str, *, first: float = 0.1,
                 most: float = 5.0, seen: set[str] | None = None) -> None:
        self._log = log
        self._doing = doing
        self._most = most
        self._backoff = Backoff(first, most)
        self.seen: set[str] = seen if seen is not None else set()
        self.failures = 0

    def failed(self, e: BaseException, doing: str | None = None) -> float:
        self.failures += 1
        k = kind(e)
        level = logging.DEBUG if k in self.seen else logging.WARNING
        self.seen.add(k)
        # Jittered: a fleet that failed together does not retry in lockstep.
        delay = self._backoff.next() * random.uniform(0.8, 1.2)
        self._log.log(level, "%s failed (%s): %s. Retrying in %.2f s, backing off to %.0f s; "
                      "this kind of error is logged again only after a success",
                      doing or self._doing, reason(e), advice(e), delay, self._most)
        return delay

    def succeeded(self) -> None:
        self._backoff.reset()
        if self.seen:
            self.seen.clear()
            self._log.info("%s works again", self._doing)
