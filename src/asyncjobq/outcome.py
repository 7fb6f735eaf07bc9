"""The result of one attempt, as the completer writes it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

OutcomeKind = Literal["done", "retry", "snooze", "failed"]

# A sanity bound far below where PostgreSQL's timestamps overflow (294276 AD): a longer delay
# would fail the statement that stores it (a completer's flush, with the whole batch in it).
MAX_DELAY = 10_000 * 365.25 * 86400.0


def is_delay(value: object) -> bool:
    """Seconds a job can be put off by: a finite number from 0 to MAX_DELAY."""
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and 0 <= value <= MAX_DELAY)


@dataclass(frozen=True)
class Outcome:
    job_id: int
    attempt: int
    kind: OutcomeKind
    delay: float = 0.0  # seconds until the job may run again (retry, snooze)
    error: str | None = None  # appended to last_error


def default_backoff(attempt: int) -> float:
    """The article's policy: min(300, 2 ** attempts) seconds, plus up to 10 % jitter so that
    jobs failing together do not all come back in the same instant."""
    base = float(min(300, 2**attempt))
    return base + random.uniform(0, base * 0.1)
