"""Cron ticks across every timezone's DST changes of 2025-2027, brute force (issue 31).

The oracle is deliberately naive: every matching wall time (cronsim on naive datetimes, plain
calendar arithmetic) is mapped to UTC through each offset the zone uses around the change, and
kept where it round-trips (real time: every instant whose local time matches; wall mode: the
first such instant, or in a spring-forward gap the offset from before the jump). The clock
under test (_maintenance/periodic.py) must give exactly those instants, in order, once each,
by forward walks, `latest` and chained `next_after`, none of which may loop.
"""

from __future__ import annotations

import itertools
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo

import pytest
from cronsim import CronSim

from asyncjobq._maintenance.periodic import Cron, cron_clock

SECOND = timedelta(seconds=1)
START, END = datetime(2025, 1, 1, tzinfo=UTC), datetime(2028, 1, 1, tzinfo=UTC)
# (expression, hours either side of each change to compare): real-time and wall-mode ones,
# on the hour and off it, 5 and 6 fields, hourly to weekly.
EXPRESSIONS = [
    ("0 */2 * * *", 30), ("@hourly", 30), ("*/15 * * * *", 8), ("*/7 1-4 * * *", 30),
    ("0 0-23 * * *", 30), ("15,45 1-3 * * *", 30), ("45 2,3 * * *", 30), ("30 2 * * *", 30),
    ("0 0 * * *", 30), ("59 23 * * *", 30), ("0 3 * * 0", 200), ("0 30 2 * * *", 30),
    ("*/30 * * * * *", 1),
]

Change = tuple[datetime, timedelta, timedelta]  # (instant, offset before, offset after)


def offset(tz: tzinfo, t: datetime) -> timedelta:
    o = t.astimezone(tz).utcoffset()
    assert o is not None
    return o


def changes(tz: tzinfo) -> tuple[Change, ...]:
    """Every offset change of `tz` from 2025 to 2027: probed daily (no zone changes twice in a
    day), then bisected to the second."""
    out: list[Change] = []
    t, o = START, offset(tz, START)
    while t < END:
        u = t + timedelta(days=1)
        ou = offset(tz, u)
        if ou != o:
            a, b = t, u
            while b - a > SECOND:
                m = a + SECOND * ((b - a) // SECOND // 2)
                if offset(tz, m) == o:
                    a = m
                else:
                    b = m
            out.append((b, o, ou))
        t, o = u, ou
    return out


def zone_kinds() -> dict[tuple[timedelta, tuple[Change, ...]], list[str]]:
    """Every available zone, grouped by what its clock does from 2025 to 2027: zones of one
    group give the same ticks, so one of each is walked."""
    kinds: dict[tuple[timedelta, tuple[Change, ...]], list[str]] = {}
    for name in sorted(zoneinfo.available_timezones()):
        tz = ZoneInfo(name)
        kinds.setdefault((offset(tz, START), tuple(changes(tz))), []).append(name)
    return kinds


KINDS = zone_kinds()


def oracle(clock: Cron, lo: datetime, hi: datetime, change: Change) -> list[datetime]:
    tz, (_, before, after) = clock.tz, change
    offsets = {before, after}
    out: set[datetime] = set()
    for wall in CronSim(clock.fields, (lo + min(offsets)).replace(tzinfo=None) - SECOND):
        if wall > (hi + max(offsets)).replace(tzinfo=None):
            break
        real = sorted(x for o in offsets
                      if (x := (wall - o).replace(tzinfo=UTC)).astimezone(tz)
                      .replace(tzinfo=None) == wall)
        if not clock.wall:
            out.update(real)
        elif real:
            out.add(real[0])
        else:  # a wall time in the gap: the offset from before the jump
            assert after > before
            out.add((wall - before).replace(tzinfo=UTC))
    return sorted(x for x in out if lo < x <= hi)


def walk(clock: Cron, lo: datetime, hi: datetime) -> Iterator[datetime]:
    for tick in clock.forward(lo):
        if tick > hi:
            return
        yield tick


def cases() -> Iterator[tuple[str, Change]]:
    """One zone of each kind, each of its changes that differs from the others by more than
    its date (a change at the same UTC time of day and weekday, between the same offsets,
    gives the same ticks shifted by whole weeks)."""
    seen = set()
    for (_, zone_changes), names in KINDS.items():
        for at, before, after in zone_changes:
            shape = (names[0], before, after, at.time(), at.weekday())
            if shape not in seen:
                seen.add(shape)
                yield names[0], (at, before, after)


def test_every_zone_was_read_and_some_change() -> None:
    assert sum(len(v) for v in KINDS.values()) == len(zoneinfo.available_timezones())
    assert len([k for k in KINDS if k[1]]) >= 20  # DST zones of many kinds, 30-minute ones too
    assert any(abs(b - a) == timedelta(minutes=30) for _, cs in KINDS for _, a, b in cs)


@pytest.mark.parametrize(("expression", "hours"), EXPRESSIONS)
def test_ticks_across_every_dst_change_of_every_zone(expression: str, hours: int) -> None:
    compared = 0
    for name, change in cases():
        clock = cron_clock(expression, ZoneInfo(name))
        lo, hi = change[0] - timedelta(hours=hours), change[0] + timedelta(hours=hours)
        expected = oracle(clock, lo, hi, change)
        where = f"{expression!r} in {name} around {change[0]:%Y-%m-%d %H:%M} UTC"
        assert list(walk(clock, lo, hi)) == expected, where
        assert clock.latest(lo, hi, len(expected)) == (expected, False), where
        if len(expected) > 2:
            assert clock.latest(lo, hi, 2) == (expected[-2:], True), where
        # From ticks and from just before them: the next one, stepping over nothing (the
        # ticks next to the change, a sample of the others).
        first_after = next((i for i, a in enumerate(expected) if a >= change[0]), 0)
        sample = {*expected[::max(1, len(expected) // 20)],
                  *expected[max(0, first_after - 3):first_after + 3]}
        for a, b in itertools.pairwise(expected):
            if a in sample:
                assert clock.next_after(a) == b, where
                assert clock.next_after(b - SECOND / 2) == b, where
        compared += len(expected)
    assert compared > 100


def test_zones_without_changes_tick_at_their_fixed_offset() -> None:
    for (off, zone_changes), names in KINDS.items():
        if zone_changes:
            continue
        clock = cron_clock("30 2 * * *", ZoneInfo(names[0]))
        day = datetime(2026, 6, 1, 2, 30, tzinfo=UTC) - off
        one = timedelta(days=1)
        assert list(walk(clock, day - one - SECOND, day + one)) == [
            day - one, day, day + one], names[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("expression", "zone", "tick"), [
    # Every match in a spring-forward gap: 02:30 on the last Sunday of March in Paris, on the
    # second Sunday of March in New York. Each runs at the instant the offset before the jump
    # gives it; its instant waited for a wall time that exists after it, which never came, and
    # each walk stepped year by year to 9999 (seconds a call, the leader's turn cut off).
    ("30 2 * 3 0L", "Europe/Paris", datetime(2027, 3, 28, 1, 30, tzinfo=UTC)),
    ("30 2 * 3 0#2", "America/New_York", datetime(2027, 3, 14, 7, 30, tzinfo=UTC)),
    ("* 30 2 * 3 0L", "Europe/Paris", datetime(2027, 3, 28, 1, 30, tzinfo=UTC)),
])
def test_an_expression_matching_only_in_gaps_ticks_without_walking_the_years(
        expression: str, zone: str, tick: datetime, monkeypatch: pytest.MonkeyPatch) -> None:
    walked = count_walls(monkeypatch)
    clock = cron_clock(expression, ZoneInfo(zone))
    assert clock.next_after(datetime(2026, 6, 1, tzinfo=UTC)) == tick
    ticks, more = clock.latest(datetime(2026, 6, 1, tzinfo=UTC), tick, 1)
    assert (ticks, more) == ([tick], False)
    assert walked[0] < 2_000


@pytest.mark.parametrize("minutes_before", [170, 59, 30, 1])
def test_a_per_second_tick_before_a_fall_back_walks_a_few_wall_times(
        minutes_before: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hour a fall-back repeats: the next tick must not walk that hour's 3,600 wall times
    (a leader with many per-second schedules turned for seconds then)."""
    walked = count_walls(monkeypatch)
    clock = cron_clock("* * * * * *", ZoneInfo("Europe/Paris"))
    change = datetime(2026, 10, 25, 1, tzinfo=UTC)
    t = change - timedelta(minutes=minutes_before)
    assert clock.next_after(t) == t + SECOND
    assert walked[0] <= 10


def count_walls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the wall times every walk steps (Cron._walls)."""
    walked = [0]
    walls = Cron._walls

    def counting(self: Cron, after: datetime) -> Iterator[datetime]:
        for wall in walls(self, after):
            walked[0] += 1
            yield wall

    monkeypatch.setattr(Cron, "_walls", counting)
    return walked
