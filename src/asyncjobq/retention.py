"""How long finished jobs stay in history: `Retention`, what `Queue(retention=,
queue_retention=)` becomes (`queue.retention`), which the leader's pruner applies
(_maintenance/pruner.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._checks import is_number
from .errors import ConfigurationError

__all__ = ["Age", "Retention", "seconds"]

Age = float | timedelta | None


def seconds(what: str, age: Age) -> float | None:
    """A retention as seconds (None keeps forever); refuses what is not a positive duration."""
    if age is None:
        return None
    if isinstance(age, timedelta):
        value = age.total_seconds()
    elif is_number(age) or age == float("inf"):  # inf: as long as None, kept
        value = float(age)
    else:
        raise ConfigurationError(
            f"{what}={age!r}: use a timedelta or a number of seconds > 0, or None to keep "
            "finished jobs forever")
    if not value > 0:
        raise ConfigurationError(f"{what}={age!r}: use a duration greater than 0")
    return value


@dataclass(frozen=True)
class Retention:
    """How long finished (done, cancelled) jobs stay in history, by default and per queue."""

    default: float | None
    per_queue: tuple[tuple[str, float | None], ...] = ()

    @classmethod
    def of(cls, default: Age, per_queue: Mapping[str, Age] | None = None) -> Retention:
        if per_queue is not None and not isinstance(per_queue, Mapping):
            raise ConfigurationError(
                f"queue_retention={per_queue!r}: use a dict of queue name -> duration")
        pairs = tuple(sorted((str(q), seconds(f"queue_retention[{q!r}]", a))
                             for q, a in (per_queue or {}).items()))
        return cls(seconds("retention", default), pairs)

    @property
    def min_age(self) -> float | None:
        ages = [a for a in (self.default, *(a for _, a in self.per_queue)) if a is not None]
        return min(ages) if ages else None

    def params(self, limit: int) -> dict[str, Any]:
        return {"queues": [q for q, _ in self.per_queue], "ages": [a for _, a in self.per_queue],
                "default_age": self.default, "min_age": self.min_age, "limit": limit}
