"""Periodic schedules: what `queue.periodic()` registers, and when its ticks fall.

A schedule is a cron expression in an IANA timezone, or an interval (`every`). Tick times are
computed here and only here, as UTC instants; the scheduler (scheduler.py) decides which of them
are due from the last tick the database recorded.

Cron expressions are parsed and stepped by cronsim (the `cron` extra). How ticks meet DST:

- An expression at specific times (neither its minute nor its hour field starts with `*`,
  the rule of Vixie cron: `30 2 * * *`, `0 9-17 * * 1-5`, and also `0 0-23 * * *`, which
  therefore runs 24 times on a fall-back day, not 25) is stepped in local wall time, and each
  wall time is converted with zoneinfo: a wall time that does not exist (spring forward) runs
  once, at the instant it maps to with the offset before the jump (02:30 in Europe/Paris on
  2026-03-29 runs at 03:30 CEST, 01:30 UTC); a wall time that happens twice (fall back) runs
  once, at its first occurrence. This holds for 6-field
  expressions too (cronsim applies its own such rule to 5-field ones only).
- Any other expression (`*/15 * * * *`, `0 * * * *`, `0 */2 * * *`, seconds-level ones
  such as `*/10 * * * * *`) is stepped in real time: each instant whose local time matches
  runs, so an hourly job runs 23 times on a spring-forward day and 25 times on a fall-back
  day, as an interval would.
- `every` ticks are the multiples of the interval since 1970-01-01 00:00 UTC, whatever the
  timezone: every worker computes the same ticks without remembering when it started.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..errors import ConfigurationError

# The shortcuts cron users know; cronsim takes only fields.
SHORTCUTS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
MIN_EVERY = 1.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
# The largest UTC offset change of any zone's DST rules is 2 hours (Troll, Antarctica): a
# backwards walk in wall time that has passed its bound by more than this cannot find a tick
# mapped after the bound.
_DST_SLACK = timedelta(hours=3)


class Clock:
    """When a schedule ticks: strictly increasing UTC instants."""

    def next_after(self, t: datetime) -> datetime | None:
        """The first tick after `t` (None if the expression never matches again)."""
        for tick in self.forward(t):
            return tick
        return None

    def forward(self, t: datetime) -> Iterator[datetime]:
        raise NotImplementedError

    def latest(self, after: datetime, until: datetime, n: int) -> tuple[list[datetime], bool]:
        """The last `n` ticks in (after, until], oldest first, and whether there were more."""
        raise NotImplementedError


class Every(Clock):
    def __init__(self, seconds: float) -> None:
        self.us = round(seconds * 1_000_000)

    def _index(self, t: datetime) -> int:
        """Index of the last tick at or before t."""
        return ((t - EPOCH) // _US) // self.us

    def _tick(self, k: int) -> datetime:
        return EPOCH + timedelta(microseconds=k * self.us)

    def forward(self, t: datetime) -> Iterator[datetime]:
        k = self._index(t) + 1
        while True:
            yield self._tick(k)
            k += 1

    def latest(self, after: datetime, until: datetime, n: int) -> tuple[list[datetime], bool]:
        lo, hi = self._index(after) + 1, self._index(until)
        if hi < lo:
            return [], False
        first = max(lo, hi - n + 1)
        return [self._tick(k) for k in range(first, hi + 1)], first > lo


class Cron(Clock):
    def __init__(self, fields: str, tz: tzinfo, *, wall: bool) -> None:
        self.fields = fields
        self.tz = tz
        self.wall = wall

    def _steps(self, start: datetime, reverse: bool) -> Iterator[datetime]:
        from cronsim import CronSim

        # cronsim yields matches strictly after `start` (strictly before when reversed), at
        # whole seconds; the UTC instant of each is taken by the caller.
        return CronSim(self.fields, start, reverse=reverse)

    def _instant(self, step: datetime) -> datetime:
        if self.wall:
            # fold=0: a wall time that happens twice is its first occurrence; one that does
            # not exist takes the offset from before the jump.
            return step.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        return step.astimezone(UTC)

    def _start(self, t: datetime) -> datetime:
        local = t.astimezone(self.tz)
        # Wall mode steps naive local times: cronsim then applies no timezone rule of its own.
        return local.replace(tzinfo=None, fold=0) if self.wall else local

    def forward(self, t: datetime) -> Iterator[datetime]:
        last = t
        for step in self._steps(self._start(t), reverse=False):
            tick = self._instant(step)
            # Wall times around a DST change can map to instants already passed: each instant
            # runs once, in order.
            if tick > last:
                last = tick
                yield tick

    def latest(self, after: datetime, until: datetime, n: int) -> tuple[list[datetime], bool]:
        found: set[datetime] = set()
        # +1 µs: cronsim's reverse walk starts strictly before its start, and `until` itself
        # may be a tick.
        start = self._start(until + _US)
        floor = self._start(after) - _DST_SLACK if self.wall else None
        for step in self._steps(start, reverse=True):
            tick = self._instant(step)
            if after < tick <= until:
                found.add(tick)
                if len(found) > n:
                    break
            elif tick <= after and (floor is None or step < floor):
                break
        ticks = sorted(found)
        return ticks[-n:], len(ticks) > n


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


def timezone_of(name: object) -> ZoneInfo:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"timezone={name!r}: use an IANA timezone name such as "
                                 "'UTC' or 'Europe/Paris'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(
            f"timezone={name!r} is not a known IANA timezone: use a name such as 'UTC', "
            "'Europe/Paris' or 'America/New_York' (on systems without a tz database, "
            "pip install tzdata)") from None


def every_seconds(every: object) -> float:
    seconds: Any = every.total_seconds() if isinstance(every, timedelta) else every
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
            or not math.isfinite(seconds):
        raise ConfigurationError(f"every={every!r}: use a number of seconds or a timedelta, "
                                 f"at least {MIN_EVERY:g} s")
    if seconds < MIN_EVERY:
        raise ConfigurationError(f"every={every!r} is shorter than {MIN_EVERY:g} s: use "
                                 f"every >= {MIN_EVERY:g} (or a 6-field cron with seconds)")
    if seconds > 100 * 366 * 86400:
        raise ConfigurationError(f"every={every!r} is over 100 years: use a cron expression")
    return float(seconds)


def cron_clock(expression: object, tz: ZoneInfo) -> Cron:
    if not isinstance(expression, str) or not expression.strip():
        raise ConfigurationError(
            f"cron={expression!r}: use a cron expression such as '0 3 * * *' (5 fields), "
            "'*/10 * * * * *' (6, seconds first) or '@daily'")
    try:
        import cronsim
    except ImportError:
        raise ConfigurationError(
            "cron schedules need the cron extra: pip install asyncjobq[cron] (or use every=)"
        ) from None
    text = " ".join(expression.split())
    fields = SHORTCUTS.get(text.lower(), text)
    if fields.startswith("@"):
        raise ConfigurationError(
            f"cron={expression!r}: unknown shortcut; use one of {', '.join(SHORTCUTS)} or "
            "5 or 6 fields")
    parts = fields.split()
    if len(parts) not in (5, 6):
        raise ConfigurationError(
            f"cron={expression!r} has {len(parts)} field(s): use 5 (minute hour day month "
            "weekday) or 6 (second first), e.g. '0 3 * * *' or '*/10 * * * * *'")
    try:
        cronsim.CronSim(fields, datetime(2000, 1, 1))
    except cronsim.CronSimError as e:
        raise ConfigurationError(f"cron={expression!r} is invalid ({e}): fix that field "
                                 "(fields: [second] minute hour day month weekday)") from None
    minute, hour = parts[-5], parts[-4]
    clock = Cron(fields, tz, wall=not minute.startswith("*") and not hour.startswith("*"))
    try:
        never = clock.next_after(datetime.now(UTC)) is None
    except StopIteration:  # cronsim gives up after 50 years without a match
        never = True
    if never:
        raise ConfigurationError(f"cron={expression!r} never matches (e.g. a 31st of a month "
                                 "that has 30 days): fix the day or month field")
    return clock
