"""Argument checks, and the encoders of what asyncjobq writes into PostgreSQL.

One home so that an argument is refused with the same words wherever it is taken (Queue,
Task, the CLI, the worker), and so that one rule decides which text PostgreSQL can store
(`storable`) and how text that it cannot is made storable (`storable_text`). It imports only
the errors, so that every module of the package, job.py and task.py included, can use it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import TypeGuard

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from .errors import ConfigurationError, InvalidPayloadError, a_or_an

# A sanity bound far below where PostgreSQL's timestamps overflow (294276 AD): a longer delay
# would fail the statement that stores it (a completer's flush, with the whole batch in it).
MAX_DELAY = 10_000 * 365.25 * 86400.0

# --- numbers -------------------------------------------------------------------------------


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool: True is 1 to Python, never a count or an id to us."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_between(value: object, low: int, high: int) -> TypeGuard[int]:
    """An int (not a bool) from `low` to `high`, both included."""
    return is_int(value) and low <= value <= high


def is_number(value: object) -> TypeGuard[int | float]:
    """A finite int or float, not a bool: NaN compares false with every bound, an infinite
    wait never ends, and an int past a float's range (10**400) cannot become seconds."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_positive(value: object) -> TypeGuard[int | float]:
    """A finite number above 0, not a bool."""
    return is_number(value) and value > 0


def is_delay(value: object) -> bool:
    """Seconds a job can be put off by: a finite number from 0 to MAX_DELAY."""
    return is_number(value) and 0 <= value <= MAX_DELAY


def check_int(what: str, value: object, bits: int = 32) -> None:
    """A column's integer (priority, max_attempts: int4; job ids: int8)."""
    limit = 2 ** (bits - 1)
    if not int_between(value, -limit, limit - 1):
        raise ConfigurationError(f"{what}={value!r}: use a {bits}-bit integer")


def check_positive(name: str, value: object, *, integer: bool, least: float | None = None) -> None:
    """A count or a duration above 0 (or at least `least`): finite, not a bool (a wait that
    never ends is refused too)."""
    if not is_number(value) or (integer and not is_int(value)) \
            or (value <= 0 if least is None else value < least):
        kind = "an integer" if integer else "a number of seconds"
        bound = "greater than 0" if least is None else f"of at least {least:g}"
        raise ConfigurationError(f"{name}={value!r}: use {kind} {bound}")


def check_max_attempts(value: object) -> None:
    check_int("max_attempts", value)
    assert isinstance(value, int)
    if value < 1:
        raise ConfigurationError(f"max_attempts={value!r}: use 1 or more")


def check_limit(limit: object) -> None:
    """A bulk action's `limit=`: how many of the matching jobs at most."""
    if limit is not None and not (is_int(limit) and limit >= 1):
        raise ConfigurationError(f"limit={limit!r}: use a whole number from 1, or None for "
                                 "every matching job")


def check_flow_limit(what: str, limit: object) -> None:
    """A task's concurrency_limit or key_limit."""
    if limit is not None and not int_between(limit, 1, 1_000_000):
        raise ConfigurationError(f"{what}={limit!r}: use a whole number of jobs from 1 "
                                 "to 1000000, or None for no limit")


def check_timeout(timeout: object) -> None:
    """A task's `timeout=`, seconds an attempt may run."""
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ConfigurationError(f"timeout={timeout!r}: use a number of seconds > 0, or None")


_RATE_RE = re.compile(r"^\s*(\d+)\s*/\s*([smh])\s*$")
_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(rate: object) -> tuple[int, float]:
    """"14/s" -> (14, 1.0): at most 14 starts per second across the fleet."""
    m = _RATE_RE.match(rate) if isinstance(rate, str) else None
    if m is None or int(m.group(1)) < 1 or int(m.group(1)) > 1_000_000:
        raise ConfigurationError(
            f"rate_limit={rate!r}: write starts per period as \"N/s\", \"N/m\" or \"N/h\" "
            "with 1 <= N <= 1000000, e.g. rate_limit=\"14/s\"")
    return int(m.group(1)), _PERIODS[m.group(2)]


# --- text PostgreSQL can store -------------------------------------------------------------


def storable(text: str) -> bool:
    """Whether PostgreSQL text (and a jsonb string) can hold it: no NUL, and valid UTF-8 (no
    lone surrogates)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable_text(text: str | None) -> str | None:
    """`text` as PostgreSQL can store it: unchanged when `storable`, else with each lone
    surrogate written as Python escapes it (\\udc80) and each NUL as \\x00.

    For text asyncjobq writes on the user's behalf (an exception's message in last_error):
    refusing it would make the whole write fail, every time it is retried."""
    if text is None or storable(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def first_unstorable(value: object) -> str | None:
    """The first string in a JSON value (keys included) that is not `storable`, cut to 40
    characters; None when there is none."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not storable(v):
                return v if len(v) <= 40 else v[:40] + "..."
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return None


def check_name(what: str, value: object, example: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 200 or not storable(value):
        raise ConfigurationError(
            f"{what} {value!r} is invalid: use a non-empty string of at most 200 characters "
            f"without NUL or unpaired surrogates (e.g. {example!r})"
        )


def check_queue_name(value: object) -> None:
    """ConfigurationError naming the rule unless `value` can be a queue's name."""
    check_name("queue", value, "default")


def check_task_name(value: object) -> None:
    check_name("task", value, "send_email")


def check_text_filter(what: str, value: object) -> None:
    """A filter matched against stored text (retry_failed's queue, task, error_like)."""
    if value is not None and (not isinstance(value, str) or not storable(value)):
        raise ConfigurationError(f"{what}={value!r}: use a string without NUL or "
                                 "unpaired surrogates, or None")


def check_dedup_key(dedup_key: object) -> None:
    if dedup_key is not None and (not isinstance(dedup_key, str) or not dedup_key
                                  or not storable(dedup_key)):
        raise ConfigurationError(f"dedup_key={dedup_key!r}: use a non-empty string without "
                                 "NUL or unpaired surrogates, or None")


def check_key(what: str, key: object) -> None:
    # Bytes, not characters: the key is in an index entry (0007_flow_control.sql), whose
    # size PostgreSQL caps near 2,700 bytes.
    if key is not None and (not isinstance(key, str) or not key or len(key) > 1000
                            or not storable(key) or len(key.encode()) > 1000):
        raise ConfigurationError(f"{what}={key!r}: use a non-empty string of at most 1000 "
                                 "bytes (UTF-8) without NUL or unpaired surrogates (e.g. "
                                 "\"account:42\"), or None")


# --- what an enqueue writes ----------------------------------------------------------------


def check_conn(conn: object) -> None:
    # A sync connection runs the INSERT (blocking the event loop) and only then fails to be
    # awaited: the job exists in the caller's transaction while they see an error, and retry.
    if conn is None or isinstance(conn, psycopg.AsyncConnection):
        return
    if isinstance(conn, psycopg.Connection):
        got = "a sync psycopg.Connection, which would block the event loop"
    elif isinstance(conn, AsyncConnectionPool | ConnectionPool):
        got = f"a pool ({type(conn).__name__}): take a connection from it"
    else:
        got = a_or_an(type(conn).__name__)
    raise ConfigurationError(
        f"conn= takes a psycopg.AsyncConnection, got {got}: pass one from `async with "
        "queue.connection() as conn` or from your async pool (`async with pool.connection() "
        "as conn`), or leave conn=None to enqueue in a transaction of its own")


def check_timing(
    run_at: datetime | None, delay: float | timedelta | None
) -> tuple[datetime | None, float]:
    """An enqueue's run_at and delay, checked: (run_at, delay in seconds)."""
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise ConfigurationError(f"run_at={run_at!r}: pass a datetime with a timezone")
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise ConfigurationError(
                f"run_at={run_at!r} has no timezone: use e.g. datetime.now(timezone.utc)"
            )
    secs = 0.0
    if delay is not None:
        secs = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if not is_number(secs) or secs < 0:
            raise ConfigurationError(f"delay={delay!r}: use seconds >= 0 or a timedelta")
        if secs > MAX_DELAY:
            raise ConfigurationError(f"delay={delay!r} is over 10,000 years: use a run_at or a "
                                     "shorter delay")
    return run_at, float(secs)


# Compact JSON, each encoder made once: json.dumps with options other than its defaults builds
# a JSONEncoder at every call (about 2 us an enqueue). `stored_json` refuses NaN and infinity
# (jsonb does): payloads, results, progress; `compact_json` is the worker's parameters'.
stored_json = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
compact_json = json.JSONEncoder(separators=(",", ":")).encode


def encode_payload(payload: object, index: int | None = None) -> str:
    """The payload as jsonb text; InvalidPayloadError naming what PostgreSQL would refuse."""
    where = "payload" if index is None else f"payloads[{index}]"
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise InvalidPayloadError(
            f"{where} must be a dict (a JSON object), got {type(payload).__name__}: "
            "wrap the value, e.g. {'value': ...}"
        )
    try:
        body = stored_json(payload)
    except (TypeError, ValueError) as e:
        raise InvalidPayloadError(
            f"{where} is not JSON-serialisable ({e}): pass only dicts, lists, str, int, "
            "finite float, bool and None (convert dates, Decimals and objects first)"
        ) from None
    # jsonb refuses \u0000 and unpaired surrogates with a bare psycopg error; both show up
    # in the ASCII-escaped text, so only then is the payload walked to name the culprit.
    if "\\u0000" in body or "\\ud" in body:
        bad = first_unstorable(payload)
        if bad is not None:
            raise InvalidPayloadError(
                f"{where} contains the string {bad!r}, which PostgreSQL cannot store (NUL or "
                "an unpaired surrogate): remove the character, or send binary data as base64"
            )
    return body


def encode_stored(value: object, what: str, max_bytes: int, limit: str, too_big: str) -> str:
    """`value` as the jsonb text stored for a job (its result, its progress); ValueError
    saying why it cannot be: `what` names it, `limit` its limit in words, `too_big` the fix."""
    try:
        body = stored_json(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} is not JSON ({e}): use a dict, list, str, int, finite float, bool or None "
            "(convert dates, Decimals and objects first)") from None
    if "\\u0000" in body or "\\ud" in body:
        bad = first_unstorable(value)
        if bad is not None:
            raise ValueError(f"{what} contains the string {bad!r}, which cannot be stored: "
                             "PostgreSQL cannot store NUL or an unpaired surrogate; remove the "
                             "character, or send binary data as base64")
    if len(body) > max_bytes:  # ASCII: the JSON text's length is its size
        raise ValueError(f"{what} is {len(body):,} bytes of JSON, over {limit}: {too_big}")
    return body


def encode_result(value: object, max_bytes: int) -> str:
    """A handler's return value as jsonb text; ValueError saying why it cannot be stored."""
    return encode_stored(value, "its return value", max_bytes,
                         f"the queue's max_result_bytes={max_bytes:,}",
                         "store large output elsewhere (a file, a table) and return where "
                         "it is")


def encode_payload_array(payloads: Iterable[object]) -> str:
    """All payloads as one JSON array: one encoder call and one parameter for the batch.

    Per-payload encoding cost as much as the INSERT itself; each payload is encoded alone
    only to name the one at fault.
    """
    items = [{} if p is None else p for p in payloads]
    if not all(isinstance(p, dict) for p in items):
        _encode_each(items)
    try:
        body = stored_json(items)
    except (TypeError, ValueError) as e:
        _encode_each(items)
        raise InvalidPayloadError(f"payloads are not JSON-serialisable ({e})") from None
    if "\\u0000" in body or "\\ud" in body:
        _encode_each(items)
    return body


def _encode_each(payloads: list[object]) -> None:
    """Encode payloads one by one: raises the error naming the first one at fault."""
    for i, p in enumerate(payloads):
        encode_payload(p, index=i)


def encode_keys(keys: object, n: int) -> str | None:
    """enqueue_many's keys as a JSON array, None when no job has one."""
    if keys is None:
        return None
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise ConfigurationError(f"keys={keys!r}: pass a list with one key (or None) per "
                                 "payload, e.g. keys=[\"account:1\", \"account:2\"]")
    if len(keys) != n:
        raise ConfigurationError(f"keys has {len(keys)} item(s) for {n} payload(s): pass one "
                                 "key (or None) per payload, in the same order")
    for i, key in enumerate(keys):
        check_key(f"keys[{i}]", key)
    return json.dumps(list(keys)) if any(k is not None for k in keys) else None
