"""The result of one attempt, as the completer writes it."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from ..job import MAX_DELAY, is_delay

__all__ = ["MAX_DELAY", "Outcome", "OutcomeKind", "default_backoff", "is_delay"]

OutcomeKind = Literal["done", "retry", "snooze", "failed", "cancelled"]

# Not frozen, slotted: one is made for every attempt, and a frozen dataclass's __init__ sets
# each field through object.__setattr__ (1.4 us an Outcome, 0.5 this way). Nothing changes
# one once made.
@dataclass(slots=True)
class Outcome:
    job_id: int
    attempt: int
    kind: OutcomeKind
    delay: float = 0.0  # seconds until the job may run again (retry, snooze)
    error: str | None = None  # appended to last_error
    task: str = ""  # for log lines
    result: str | None = None  # the handler's return value as JSON text (done only)


def default_backoff(attempt: int) -> float:
    """The article's policy: min(300, 2 ** attempts) seconds, plus up to 10 % jitter so that
    jobs failing together do not all come back in the same instant."""
    base = float(min(300, 2**attempt))
    return base + random.uniform(0, base * 0.1)
