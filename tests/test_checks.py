"""The shared argument checks and encoders (asyncjobq._checks) on their own: no database."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from asyncjobq import ConfigurationError, InvalidPayloadError
from asyncjobq._checks import (
    MAX_DELAY,
    check_conn,
    check_int,
    check_limit,
    check_timing,
    encode_payload,
    encode_payload_array,
    int_between,
    is_delay,
    is_int,
    is_number,
    is_positive,
    parse_rate,
    storable,
    storable_text,
)

UNSTORABLE = ["a\x00b", "\udc80", "x\ud800y\x00"]


def test_a_bool_is_never_a_number() -> None:
    for check in (is_int, is_number, is_positive, is_delay):
        assert not check(True) and not check(False), check
    assert is_int(-3) and not is_int(1.0) and not is_int("1")
    assert int_between(1, 1, 3) and int_between(3, 1, 3) and not int_between(4, 1, 3)
    assert is_number(1.5) and not is_number(math.nan) and not is_number(math.inf)
    assert is_positive(1e-9) and not is_positive(0) and not is_positive(-1)
    assert is_delay(0) and is_delay(MAX_DELAY) and not is_delay(MAX_DELAY * 2)


def test_checks_name_the_argument_and_the_rule() -> None:
    with pytest.raises(ConfigurationError, match=r"^priority=True: use a 32-bit integer$"):
        check_int("priority", True)
    with pytest.raises(ConfigurationError, match=r"^job_id=9223372036854775808: use a 64-bit"):
        check_int("job_id", 2**63, bits=64)
    check_int("job_id", 2**63 - 1, bits=64)
    with pytest.raises(ConfigurationError, match=r"^limit=0: use a whole number from 1"):
        check_limit(0)
    with pytest.raises(ConfigurationError, match=r"^conn= takes a psycopg.AsyncConnection, "
                                                 r"got an object"):
        check_conn(object())
    with pytest.raises(ConfigurationError, match=r"^rate_limit='0/s'"):
        parse_rate("0/s")
    assert parse_rate(" 14 / m ") == (14, 60.0)


def test_timing_takes_seconds_or_a_timedelta() -> None:
    assert check_timing(None, timedelta(minutes=1)) == (None, 60.0)
    assert check_timing(None, None) == (None, 0.0)
    for bad in (True, math.nan, -1):
        with pytest.raises(ConfigurationError, match=r"use seconds >= 0 or a timedelta"):
            check_timing(None, bad)
    with pytest.raises(ConfigurationError, match=r"is over 10,000 years"):
        check_timing(None, MAX_DELAY + 1)


def test_storable_text_is_the_text_when_storable_else_escaped() -> None:
    for text in ("", "plain", "é ✓ 🚀", "back\\slash"):
        assert storable(text) and storable_text(text) is text
    assert storable_text(None) is None
    assert [storable_text(t) for t in UNSTORABLE] == ["a\\x00b", "\\udc80", "x\\ud800y\\x00"]
    for text in UNSTORABLE:
        assert not storable(text)
        escaped = storable_text(text)
        assert escaped is not None and storable(escaped)


def test_payload_encoding_names_the_unstorable_string() -> None:
    assert encode_payload(None) == "{}"
    assert encode_payload({"a": [1, "é"]}) == '{"a":[1,"\\u00e9"]}'
    with pytest.raises(InvalidPayloadError, match=r"^payload contains the string 'a\\x00b'"):
        encode_payload({"k": ["a\x00b"]})
    with pytest.raises(InvalidPayloadError, match=r"^payloads\[1\] contains the string"):
        encode_payload_array([{}, {"\udc80": 1}])
    with pytest.raises(InvalidPayloadError, match=r"^payloads\[0\] must be a dict"):
        encode_payload_array([[1]])
    assert encode_payload_array([None, {"a": 1}]) == '[{},{"a":1}]'


def test_numbers_past_a_floats_range_are_refused_not_raised() -> None:
    """10**400 is an int Python holds but no float can: math.isfinite() raises on it, and a
    check must refuse it with its own error rather than an OverflowError."""
    from asyncjobq._checks import is_number

    assert not is_number(10**400) and not is_number(-(10**400)) and is_number(10**300)


def test_a_backoff_past_a_floats_range_waits_the_longest_delay() -> None:
    from datetime import UTC, datetime

    from asyncjobq._worker.executor import _custom_backoff
    from asyncjobq.job import MAX_DELAY, Job

    now = datetime.now(UTC)
    job = Job(id=1, task="t", queue="q", payload={}, attempt=1, max_attempts=3, priority=0,
              run_at=now, created_at=now)
    assert _custom_backoff(job, lambda attempt: 10**400) == MAX_DELAY
    assert _custom_backoff(job, lambda attempt: -(10**400)) == 0.0
