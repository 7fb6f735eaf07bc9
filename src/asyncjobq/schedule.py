"""A registered periodic job: `Schedule`, what `queue.periodic(...)` returns and
`queue.schedules` holds; the leader's scheduler enqueues its ticks (_maintenance/scheduler.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

__all__ = ["Schedule"]


class Clock(Protocol):
    """What computes a schedule's ticks (machinery: _maintenance/periodic.py's Clock)."""

    def next_after(self, t: datetime) -> datetime | None: ...

    def forward(self, t: datetime) -> Iterator[datetime]: ...

    def latest(self, after: datetime, until: datetime, n: int
               ) -> tuple[list[datetime], bool]: ...


@dataclass(frozen=True)
class Schedule:
    """One registered schedule (`queue.periodic`); `queue`, `priority` and `max_attempts`
    left None take the task's when the worker starts."""

    name: str
    task: str
    clock: Clock = field(repr=False, compare=False)
    cron: str | None
    every: float | None
    timezone: str
    payload: str  # the JSON object every tick's job carries
    queue: str | None = None
    priority: int | None = None
    max_attempts: int | None = None
    catch_up: bool = False

    @property
    def expression(self) -> str:
        if self.cron is not None:
            return self.cron
        assert self.every is not None
        return f"every {_seconds_text(self.every)}"

    def next_after(self, t: datetime) -> datetime | None:
        return self.clock.next_after(t)


def _seconds_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
