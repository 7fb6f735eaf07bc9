"""The result of one attempt, as the completer writes it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

OutcomeKind = Literal["done", "retry", "snooze", "failed"]


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
