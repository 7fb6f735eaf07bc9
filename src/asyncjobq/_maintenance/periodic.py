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
- Ticks are found by walking forward only: cronsim steps naive wall times (calendar
  arithmetic, which cannot loop), each is mapped to its instants, and instants that a later
  wall time maps earlier (a DST change) wait in a heap until no later wall time can precede
  them. Every walk is bounded (MAX_WALK): a runaway schedule fails as a broken one does.
  tests/test_cron_zones.py checks every zone's changes of 2025-2027 against a brute force.
- `every` ticks are the multiples of the interval since 1970-01-01 00:00 UTC, whatever the
  timezone: every worker computes the same ticks without remembering when it started.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .._checks import is_number
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
_SECOND = timedelta(seconds=1)
# Where a cron walk looks for the zone's other offsets near its start (Cron._early). Real
# time: a fall-back ahead, which no zone makes larger than an hour (3 allows for odd rules).
# Wall mode: a spring-forward behind, at most a day (Samoa skipped one in 2011).
_AHEAD_PROBES = tuple(timedelta(hours=h) for h in (0, 1, 2, 3))
_BEHIND_PROBES = tuple(timedelta(hours=-h) for h in (0, 1, 2, 3, 6, 12, 24))
# A walk that steps this many matching wall times without one tick is a bug, not a schedule:
# it fails like a schedule that cannot be computed (the scheduler logs it; the others go on).
# Far above any real walk: the wall times a walk skips before its start are at most the few
# hours of a DST change of a per-second expression (7,200 at 2 hours).
MAX_WALK = 100_000
# No zone's UTC offset exceeds +14:00 (Kiribati): a wall time is never more than this ahead of
# its instant.
_MAX_OFFSET = timedelta(hours=15)
# latest() walks forward from this far before its end, then 4, 16, ... times as far.
_FIRST_SPAN = timedelta(minutes=1)


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

    def _walls(self, after: datetime) -> Iterator[datetime]:
        """Naive local wall times that match, strictly after `after` (naive), in order.

        cronsim steps naive datetimes as plain calendar arithmetic, which cannot loop: every
        step moves forward, and it gives up after 50 years without a match.
        """
        from cronsim import CronSim

        steps = CronSim(self.fields, after)
        while True:
            try:
                yield next(steps)
            except (StopIteration, OverflowError, ValueError):
                return  # no match for 50 years, or past the year 9999

    def _instants(self, wall: datetime) -> tuple[list[datetime], bool]:
        """The UTC instants a matching wall time runs at, and whether the wall time exists.

        Real time: every instant whose local time is `wall`, so none in a spring-forward gap
        and two in a fall-back overlap. Wall mode: one instant, fold=0 (a repeated wall time is
        its first occurrence; one in a gap takes the offset from before the jump).
        """
        first = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        exists = first.astimezone(self.tz).replace(tzinfo=None) == wall
        if self.wall:
            return [first], exists
        if not exists:
            return [], False
        second = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        return ([first, second] if second != first else [first]), True

    def _offset(self, t: datetime) -> timedelta:
        offset = t.astimezone(self.tz).utcoffset()
        assert offset is not None  # a ZoneInfo always has one
        return offset

    def forward(self, t: datetime) -> Iterator[datetime]:
        t = t.astimezone(UTC)
        here = self._offset(t)
        # Two sorted streams: the wall times from t's own on, and those before it that a DST
        # change next to t maps after t. Each yields lazily, so a tick costs a step or two.
        last = t
        for x in heapq.merge(self._walk(t, (t + here).replace(tzinfo=None) - _SECOND),
                             self._early(t, here)):
            if x > last:
                last = x
                yield x

    def _walk(self, t: datetime, start: datetime) -> Iterator[datetime]:
        """The instants after `t` of the wall times after `start`, in order."""
        # Instants found but not yet safe to yield: a later wall time may map earlier (the
        # second occurrence of a repeated wall time, a wall time in a gap).
        pending: list[datetime] = []
        walked = 0
        for wall in self._walls(start):
            walked += 1
            if walked > MAX_WALK:
                raise ConfigurationError(
                    f"cron={self.fields!r} in {self.tz}: {MAX_WALK:,} matching wall times "
                    f"after {t.isoformat()} gave no tick: change the expression or the "
                    "timezone (and report it: no real schedule should do this)")
            instants, exists = self._instants(wall)
            for x in instants:
                if x > t:
                    heapq.heappush(pending, x)
            # An existing wall time's first instant bounds every later wall time's instants
            # from below (fold=0 is increasing over the wall times that exist); so does any
            # wall time less the largest UTC offset (an expression that matches only in gaps
            # has no existing wall time to release them).
            bound = wall.replace(tzinfo=UTC) - _MAX_OFFSET
            if exists and instants:
                bound = max(bound, instants[0])
            while pending and pending[0] <= bound:
                walked = 0
                yield heapq.heappop(pending)
        while pending:  # cronsim found no match for 50 years
            yield heapq.heappop(pending)

    def _early(self, t: datetime, here: timedelta) -> Iterator[datetime]:
        """The instants after `t` of wall times before t's own, in order: none unless a DST
        change lies next to `t`.

        In real time, a fall-back just ahead maps the wall times it repeats, passed already at
        `t`, to their second occurrence after it; in wall mode, a spring-forward just behind
        maps the wall times of its gap to instants after the jump (the offset from before
        it). Those wall times are walked from the first of them to t's own, and their
        instants after `t` are increasing.
        """
        sign = -1 if self.wall else 1
        low = here
        for probe in _BEHIND_PROBES if self.wall else _AHEAD_PROBES:
            o = self._offset(t + probe)
            # Only a change within its own size of `t` maps a wall time before `t` after it.
            if o < low and self._offset(t + sign * (here - o)) == o:
                low = o
        if low == here:
            return
        # Real time: the repeated wall times start where the change maps (its instant, in
        # the lower offset); wall mode: gap wall times after t's, in the offset before it.
        first = t + low if self.wall else self._change(t, t + (here - low)) + low
        end = (t + here).replace(tzinfo=None)
        for wall in self._walls(first.replace(tzinfo=None) - _SECOND):
            if wall >= end:
                return
            for x in self._instants(wall)[0]:
                if x > t:
                    yield x

    def _change(self, lo: datetime, hi: datetime) -> datetime:
        """The first instant, to the second, after `lo` whose offset is not lo's (one lies in
        (lo, hi])."""
        before = self._offset(lo)
        while hi - lo > _SECOND:
            mid = lo + _SECOND * ((hi - lo) // _SECOND // 2)
            if self._offset(mid) == before:
                lo = mid
            else:
                hi = mid
        return hi

    def latest(self, after: datetime, until: datetime, n: int) -> tuple[list[datetime], bool]:
        # Forward walks only (a backward walk through a DST change is what can loop), over a
        # span back from `until` that grows until it holds n + 1 ticks or reaches `after`.
        span = _FIRST_SPAN
        while True:
            start = max(after, until - span)
            found: deque[datetime] = deque(maxlen=n + 1)
            for tick in self.forward(start):
                if tick > until:
                    break
                found.append(tick)
            if len(found) > n:
                return list(found)[1:], True
            if start == after:
                return list(found), False
            span *= 4


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
    if not is_number(seconds):
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
