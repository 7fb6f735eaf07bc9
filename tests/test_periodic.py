"""Periodic jobs (issue 19; _maintenance/periodic.py, scheduler.py): each tick enqueued once per
fleet, never silently skipped; DST; bad schedules refused at registration and by the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import anyio.to_thread
import psycopg
import pytest
from conftest import ROOT, execute, fetchval, run_cli, running, spawn_worker, wait_for

from asyncjobq import ConfigurationError, InvalidPayloadError, Job, Queue, Worker
from asyncjobq._maintenance.periodic import Clock
from asyncjobq._maintenance.scheduler import Scheduler

PARIS = ZoneInfo("Europe/Paris")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


async def noop(job: Job) -> None:
    pass


async def job_times(queue: Queue, task: str) -> list[datetime]:
    """run_at of every job of `task`, live or finished, in order (duplicates kept)."""
    async with queue.connection() as conn:
        cur = await conn.execute(
            f'SELECT run_at FROM "{queue.schema}".jobs WHERE task = %(t)s UNION ALL'
            f' SELECT run_at FROM "{queue.schema}".jobs_history WHERE task = %(t)s'
            " ORDER BY 1", {"t": task})
        return [r[0] for r in await cur.fetchall()]


async def last_tick(queue: Queue, name: str) -> datetime | None:
    value = await fetchval(queue, "SELECT max(tick) FROM {s}.periodic_ticks"
                           " WHERE name = %s AND enqueued", name)
    return value  # type: ignore[no-any-return]


def scheduler(queue: Queue, grace: float = 4.0) -> Scheduler:
    return Scheduler(queue.database, queue.check_schedules(), grace=grace)


# --- DST --------------------------------------------------------------------------------------


def ticks_between(clock: Clock, start: datetime, end: datetime) -> list[datetime]:
    out = []
    for tick in clock.forward(start):
        if tick > end:
            break
        out.append(tick)
    return out


@pytest.mark.parametrize("cron", ["30 2 * * *", "0 30 2 * * *"])
def test_a_daily_0230_runs_once_on_both_dst_days_in_paris(cron: str) -> None:
    q = Queue("postgresql://unused", schema="unused")
    s = q.periodic("t", cron=cron, timezone="Europe/Paris")
    # Spring forward, 2026-03-29: 02:00-03:00 does not exist; 02:30 runs once, at 03:30 CEST.
    spring = ticks_between(s.clock, utc(2026, 3, 27, 12), utc(2026, 3, 30, 12))
    assert spring == [utc(2026, 3, 28, 1, 30), utc(2026, 3, 29, 1, 30), utc(2026, 3, 30, 0, 30)]
    assert [t.astimezone(PARIS).strftime("%d %H:%M %Z") for t in spring] == [
        "28 02:30 CET", "29 03:30 CEST", "30 02:30 CEST"]
    # Fall back, 2026-10-25: 02:00-03:00 happens twice; 02:30 runs once, the first time.
    fall = ticks_between(s.clock, utc(2026, 10, 23, 12), utc(2026, 10, 26, 12))
    assert fall == [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    assert [t.astimezone(PARIS).strftime("%d %H:%M %Z") for t in fall] == [
        "24 02:30 CEST", "25 02:30 CEST", "26 02:30 CET"]
    # The same from the end backwards (the catch-up path), starting inside the repeated hour.
    ticks, more = s.clock.latest(utc(2026, 10, 23, 12), utc(2026, 10, 25, 1, 45), 10)
    assert (ticks, more) == ([utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30)], False)
    ticks, more = s.clock.latest(utc(2026, 3, 27, 12), utc(2026, 3, 29, 1, 30), 1)
    assert (ticks, more) == ([utc(2026, 3, 29, 1, 30)], True)
    # Starting in the second 02:xx of the fall-back night does not run 02:30 again.
    assert s.next_after(utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 26, 1, 30)


@pytest.mark.parametrize(("cron", "spring", "fall"), [
    ("@hourly", 23, 25), ("0 */2 * * *", 11, 13),
    # An hour field that does not start with `*` names wall times (periodic.py, Vixie cron's
    # rule): each runs once, whatever the night did to it.
    ("0 0-23 * * *", 23, 24)])
def test_an_hourly_job_follows_real_time_across_dst(cron: str, spring: int, fall: int) -> None:
    q = Queue("postgresql://unused", schema="unused")
    s = q.periodic("t", cron=cron, timezone="Europe/Paris")

    def local_day(day: int, month: int) -> list[datetime]:
        start = datetime(2026, month, day, tzinfo=PARIS).astimezone(UTC)
        end = datetime(2026, month, day + 1, tzinfo=PARIS).astimezone(UTC)
        return ticks_between(s.clock, start - timedelta(microseconds=1),
                             end - timedelta(microseconds=1))

    assert len(local_day(29, 3)) == spring
    assert len(local_day(25, 10)) == fall  # @hourly: 02:00 CEST and 02:00 CET, two instants


async def test_the_scheduler_enqueues_one_0230_job_on_both_dst_days(queue: Queue) -> None:
    """Turns every 10 minutes of (simulated) server time across both nights: one job a day."""
    queue.task(name="report")(noop)
    queue.periodic("report", cron="30 2 * * *", timezone="Europe/Paris", name="report-spring")
    spring = Scheduler(queue.database, queue.check_schedules(), grace=3600)
    queue.schedules.clear()
    queue.periodic("report", cron="30 2 * * *", timezone="Europe/Paris", name="report-fall")
    fall = Scheduler(queue.database, queue.check_schedules(), grace=3600)
    for sched, start in ((spring, utc(2026, 3, 27, 12)), (fall, utc(2026, 10, 23, 12))):
        for step in range(3 * 24 * 6):
            await sched.turn(now=start + timedelta(minutes=10 * step))
    runs = [t.astimezone(PARIS) for t in await job_times(queue, "report")]
    assert [t.strftime("%m-%d %H:%M %Z") for t in runs] == [
        "03-28 02:30 CET", "03-29 03:30 CEST", "03-30 02:30 CEST",
        "10-24 02:30 CEST", "10-25 02:30 CEST", "10-26 02:30 CET"]


# --- review of issue 31: DST changes off the hour, long leases ------------------------------


@pytest.mark.timeout(60)
async def test_a_leader_turning_after_chathams_fall_back_does_not_freeze(queue: Queue) -> None:
    """Pacific/Chatham falls back at 03:45 +13:45 to 02:45 +12:45. A turn that catches up a
    "0 */2 * * *" tick across it walked cronsim backwards through the repeated hour for ever,
    on the event loop (every later leader froze the same way). Now it enqueues the tick and
    the loop stays free: a ticker on the loop runs all through the turns."""
    queue.task(name="every2h")(noop)
    queue.periodic("every2h", cron="0 */2 * * *", timezone="Pacific/Chatham", name="chatham")
    sched = scheduler(queue, grace=240)
    before = utc(2026, 4, 4, 12, 15) - timedelta(minutes=10)  # 01:50 +13:45
    await sched.turn(now=before)  # where the schedule starts
    await sched.turn(now=utc(2026, 4, 4, 12, 15, 1))  # 02:00 +13:45, on time

    beats = 0

    async def ticker() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        # 04:00 +12:45 is 15:15 UTC; the turn comes 30 s late, inside the grace period.
        assert await asyncio.wait_for(sched.turn(now=utc(2026, 4, 4, 15, 15, 30)), 30) == 1
    finally:
        task.cancel()
    assert beats >= 1
    local = [t.astimezone(ZoneInfo("Pacific/Chatham")).isoformat()
             for t in await job_times(queue, "every2h")]
    assert local == ["2026-04-05T02:00:00+13:45", "2026-04-05T04:00:00+12:45"]


async def test_no_tick_is_skipped_at_lord_howes_half_hour_fall_back(queue: Queue) -> None:
    """Australia/Lord_Howe falls back 30 minutes at 02:00 +11:00. "0 */2 * * *" matches
    00:00 +11:00, 02:00 +10:30 and 04:00 +10:30; the middle one was stepped over."""
    queue.task(name="every2h")(noop)
    queue.periodic("every2h", cron="0 */2 * * *", timezone="Australia/Lord_Howe", name="lhi")
    sched = scheduler(queue)
    start = utc(2026, 4, 4, 12)  # 23:00 +11:00
    for step in range(6 * 60 + 1):  # a turn a minute for six hours, 1 s before each minute:
        # each tick is enqueued ahead, on time, as when turning every second
        await sched.turn(now=start + timedelta(minutes=step, seconds=-1))
    local = [t.astimezone(ZoneInfo("Australia/Lord_Howe")).strftime("%H:%M%z")
             for t in await job_times(queue, "every2h")]
    assert local == ["00:00+1100", "02:00+1030", "04:00+1030"]


async def test_a_takeover_inside_two_long_leases_enqueues_every_missed_tick(
        queue: Queue) -> None:
    """Every second, lease 120 s (grace 240 s): a leader gone for 150 s missed 150 ticks.
    Catch-up inside the grace period was capped at 100, the first 50 skipped."""
    queue.task(name="tick")(noop)
    queue.periodic("tick", every=1, name="each-second")
    sched = scheduler(queue, grace=2 * 120)
    t = utc(2026, 6, 1, 12)
    await sched.turn(now=t)
    await sched.turn(now=t + timedelta(seconds=1))  # enqueues 12:00:01..03 (ahead)
    last = await last_tick(queue, "each-second")
    assert last == t + timedelta(seconds=3)
    await sched.turn(now=last + timedelta(seconds=150))
    times = await job_times(queue, "tick")
    expected = [t + timedelta(seconds=i) for i in range(1, 3 + 150 + 3)]  # + 2 s ahead
    assert times == expected


async def test_handlers_holding_every_default_thread_do_not_starve_the_scheduler(
        queue: Queue) -> None:
    """The turn computes in a thread: with anyio's default limiter (40 threads) all taken by
    plain-def work, it waited for a token until its timeout, and no tick was enqueued."""
    queue.task(name="tick")(noop)
    queue.periodic("tick", every=1, name="each-second")
    sched = scheduler(queue)
    t = utc(2026, 6, 1, 12)
    await sched.turn(now=t)
    release = threading.Event()
    limiter = anyio.to_thread.current_default_thread_limiter()
    blockers = [asyncio.create_task(anyio.to_thread.run_sync(release.wait))
                for _ in range(int(limiter.total_tokens))]
    try:
        await wait_for(lambda: limiter.borrowed_tokens == limiter.total_tokens, timeout=10,
                       what="every default thread taken")
        assert await asyncio.wait_for(sched.turn(now=t + timedelta(seconds=1)), 10) > 0
    finally:
        release.set()
        await asyncio.gather(*blockers)


# --- the database's guard -------------------------------------------------------------------


async def test_two_leaders_at_once_enqueue_a_due_tick_once(queue: Queue, pg_dsn: str) -> None:
    """Two schedulers on two Database handles read the same last tick, then write the same due
    tick at the same moment (their INSERTs held back by a lock until both are waiting)."""
    # Queues opened in the test's own event loop: the fixture's pool cannot grow in it.
    leaders = [Queue(pg_dsn, schema=queue.schema) for _ in range(2)]
    for q in leaders:
        q.task(name="minutely")(noop)
        q.periodic("minutely", every=60)
    await execute(queue, "INSERT INTO {s}.periodic_ticks (name, tick) VALUES"
                  " ('minutely', '2026-06-01 12:00:00+00')")
    now = utc(2026, 6, 1, 12, 1, 0, 500_000)
    async with leaders[0], leaders[1], await psycopg.AsyncConnection.connect(pg_dsn) as lock:
        await lock.execute(f'LOCK TABLE "{queue.schema}".periodic_ticks'
                           " IN SHARE ROW EXCLUSIVE MODE")
        turns = [asyncio.create_task(scheduler(q).turn(now=now)) for q in leaders]

        async def both_waiting() -> bool:
            n = await fetchval(queue, "SELECT count(*) FROM pg_stat_activity"
                               " WHERE datname = current_database()"
                               " AND wait_event_type = 'Lock' AND query LIKE %s",
                               f'%INSERT INTO "{queue.schema}".periodic_ticks%')
            return bool(n == 2)

        await wait_for(both_waiting, timeout=10, what="both INSERTs waiting")
        await lock.commit()
        enqueued = await asyncio.gather(*turns)
    assert sorted(enqueued) == [0, 1]
    assert await job_times(queue, "minutely") == [utc(2026, 6, 1, 12, 1)]


async def test_new_schedules_start_from_now_and_removed_ones_stop(queue: Queue) -> None:
    queue.task(name="report", queue="reports", priority=5)(noop)
    queue.periodic("report", every=60, name="r", payload={"scope": "tmp"}, max_attempts=7)
    s = scheduler(queue)
    t = utc(2026, 6, 1, 12, 0, 30)
    assert await s.turn(now=t) == 0  # no backfill of 12:00
    assert await s.turn(now=t + timedelta(seconds=29)) == 1  # 12:01 is within 2 s: ahead
    assert await s.turn(now=t + timedelta(seconds=30)) == 0
    assert await s.turn(now=t + timedelta(seconds=31)) == 0
    async with queue.connection() as conn:
        cur = await conn.execute(
            f'SELECT run_at, payload, queue, priority, max_attempts FROM "{queue.schema}".jobs')
        assert await cur.fetchall() == [(utc(2026, 6, 1, 12, 1), {"scope": "tmp"}, "reports", 5,
                                         7)]
    queue.schedules.clear()
    queue.periodic("report", every=60, name="another")
    s = scheduler(queue)  # the app, deployed without "r"
    await s.turn(now=t + timedelta(minutes=5))
    assert len(await job_times(queue, "report")) == 1


class Broken(Clock):
    def forward(self, t: datetime) -> Iterator[datetime]:
        raise RuntimeError("a bug in one schedule")


async def test_one_schedule_that_fails_does_not_stop_the_others(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    """One schedule refused by a constraint on jobs, one whose ticks cannot be computed: the
    others are enqueued, each failure is logged once (not every turn), and the refused one
    comes back when the constraint goes."""
    for task in ("good", "refused", "broken"):
        queue.task(name=task)(noop)
        queue.periodic(task, every=60)
    s = scheduler(queue)
    s.schedules = [replace(x, clock=Broken()) if x.name == "broken" else x
                   for x in s.schedules]
    await execute(queue, "ALTER TABLE {s}.jobs ADD CONSTRAINT no_refused"
                  " CHECK (task <> 'refused')")
    t = utc(2026, 6, 1, 12, 0, 30)
    with caplog.at_level(logging.ERROR, logger="asyncjobq.scheduler"):
        await s.turn(now=t)  # where each starts
        assert await s.turn(now=t + timedelta(seconds=30)) == 1
        assert await s.turn(now=t + timedelta(seconds=90)) == 1
    assert await job_times(queue, "good") == [utc(2026, 6, 1, 12, 1), utc(2026, 6, 1, 12, 2)]
    assert await job_times(queue, "refused") == []
    failures = [r.getMessage() for r in caplog.records]
    assert len(failures) == 2, failures
    assert any("schedule broken: computing its ticks failed (RuntimeError" in m
               for m in failures)
    assert any("schedule refused: writing its jobs failed (CheckViolation" in m
               for m in failures)
    await execute(queue, "ALTER TABLE {s}.jobs DROP CONSTRAINT no_refused")
    assert await s.turn(now=t + timedelta(seconds=150)) == 2
    assert await job_times(queue, "refused") == [utc(2026, 6, 1, 12, 3)]


async def test_a_server_clock_set_back_does_not_stall_a_schedule(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    """The latest tick an hour past the clock (the clock was set back an hour): the schedule
    says so and goes on from the clock, instead of waiting an hour in silence."""
    queue.task(name="tick")(noop)
    queue.periodic("tick", every=1)
    s = scheduler(queue)
    t = utc(2026, 6, 1, 12, 0, 0, 500_000)
    await execute(queue, "INSERT INTO {s}.periodic_ticks (name, tick) VALUES"
                  " ('tick', %s), ('tick', %s)", t - timedelta(seconds=1),
                  t + timedelta(hours=1))
    with caplog.at_level(logging.WARNING, logger="asyncjobq.scheduler"):
        assert await s.turn(now=t) == 0
    assert "the clock was set back" in caplog.text
    assert await s.turn(now=t) == 3  # 12:00:00, and 12:00:01..02 ahead
    assert await job_times(queue, "tick") == [t.replace(microsecond=0) + timedelta(seconds=k)
                                              for k in range(3)]


# --- a fleet of processes --------------------------------------------------------------------


async def leader_pid(queue: Queue) -> int | None:
    info = await queue.leader()
    return None if info is None else int(str(info["worker"]).rsplit("-", 2)[1])


def longest_missing_run(expected: list[datetime], seen: set[datetime]) -> int:
    longest = run = 0
    for t in expected:
        run = run + 1 if t not in seen else 0
        longest = max(longest, run)
    return longest


@pytest.mark.timeout(240)
@pytest.mark.processes
async def test_three_workers_leader_killed_twice_no_tick_doubled_or_lost(
        queue: Queue, pg_dsn: str) -> None:
    """Three worker processes of one app (every second, and `*/2 * * * * *`), 30 s, the leader
    SIGKILLed at 10 s and at 20 s: no tick twice, and no run of missing ticks longer than the
    takeover took."""
    lease = 2.0
    args = ("--lease", str(lease), "--poll-interval", "0.2")
    procs = [spawn_worker(pg_dsn, queue.schema, *args, app="apps.periodicapp:queue")
             for _ in range(3)]
    takeovers: list[float] = []
    try:
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 3 FROM pg_stat_activity"
                                        " WHERE datname = current_database()"
                                        " AND application_name = 'asyncjobq-worker-listen'"),
                       timeout=60, what="three workers running")
        await wait_for(lambda: last_tick(queue, "every-second"), timeout=30,
                       what="a first tick enqueued")
        start = await fetchval(queue, "SELECT now()")
        t0 = time.monotonic()

        async def until(seconds: float) -> None:
            await wait_for(lambda: time.monotonic() - t0 >= seconds, timeout=seconds + 5,
                           interval=0.05, what=f"{seconds:g} s into the run")

        for at in (10, 20):
            await until(at)
            pid = await leader_pid(queue)
            victim = next(p for p in procs if p.pid == pid)
            killed = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)

            async def led_by_another(victim_pid: int = victim.pid) -> bool:
                current = await leader_pid(queue)
                return current is not None and current != victim_pid

            await wait_for(led_by_another, timeout=30, interval=0.05, what="a new leader")
            takeovers.append(time.monotonic() - killed)
        await until(30)
        end = await fetchval(queue, "SELECT now()")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [f"takeovers after SIGKILL: {', '.join(f'{t:.2f} s' for t in takeovers)} "
             f"(lease {lease:g} s)"]
    worst_gap = 0.0
    duplicates = 0
    for task, period in (("every_second", 1), ("cron_2s", 2)):
        times = await job_times(queue, task)
        dup = len(times) - len(set(times))
        first = start.replace(microsecond=0) + timedelta(seconds=1)
        expected = [first + timedelta(seconds=i) for i in range(int((end - first)
                                                                    .total_seconds()) + 1)]
        expected = [t for t in expected if t.second % period == 0 and start < t <= end]
        seen = set(times)
        missing = [t for t in expected if t not in seen]
        gap = longest_missing_run(expected, seen) * period
        worst_gap = max(worst_gap, gap)
        duplicates += dup
        span = (end - start).total_seconds()
        lines.append(f"{task}: {len(expected)} ticks expected in {span:.1f} s, "
                     f"{len(expected) - len(missing)} enqueued, duplicated {dup}, missing "
                     f"{len(missing)}, longest run of missing ticks {gap} s")
    late = await fetchval(queue, "SELECT max(extract(epoch FROM created_at - run_at)) FROM"
                          " (SELECT created_at, run_at FROM {s}.jobs UNION ALL"
                          "  SELECT created_at, run_at FROM {s}.jobs_history) j")
    lines.append(f"latest enqueue after its tick: {float(late):.2f} s (ticks are written up to "
                 "2 s ahead; those due during a takeover are written when it ends)")
    print("\n" + "\n".join(lines))
    assert duplicates == 0
    assert worst_gap <= max(takeovers)


@pytest.mark.timeout(120)
async def test_ticks_missed_while_no_worker_ran(queue: Queue) -> None:
    """A worker stopped across 3 ticks of two every-5-s schedules, then started: the one
    without catch_up gets the latest missed tick, the one with catch_up gets all 3."""
    queue.task(name="tick")(noop)
    queue.task(name="tick_all")(noop)
    queue.periodic("tick", every=5, name="latest")
    queue.periodic("tick_all", every=5, name="all", catch_up=True)
    lease = 2.0  # so the scheduler's grace (two leases) is 4 s, well under the 15 s stopped
    async with running(Worker(queue, lease=lease, poll_interval=0.2)):
        await wait_for(lambda: last_tick(queue, "all"), timeout=30, what="a first tick")
    last = await last_tick(queue, "all")
    assert last is not None and last == await last_tick(queue, "latest")
    before = {t: set(await job_times(queue, t)) for t in ("tick", "tick_all")}
    missed = [last + timedelta(seconds=5 * i) for i in (1, 2, 3)]

    async def three_ticks_passed() -> bool:
        return bool(await fetchval(queue, "SELECT now() > %s", missed[-1] + timedelta(
            seconds=0.3)))

    await wait_for(three_ticks_passed, timeout=30, interval=0.05, what="three ticks")
    async with running(Worker(queue, lease=lease, poll_interval=0.2)) as w:
        await wait_for(lambda: w.scheduler is not None and w.scheduler.enqueued > 0,
                       timeout=30, what="the scheduler's first turn")
        restarted = await fetchval(queue, "SELECT now()")
    assert restarted < missed[-1] + timedelta(seconds=5), "restarted too late to tell"
    after = {t: sorted(set(await job_times(queue, t)) - before[t]) for t in before}
    print(f"\nmissed {[t.strftime('%H:%M:%S') for t in missed]}; enqueued at restart: "
          f"latest-only {[t.strftime('%H:%M:%S') for t in after['tick']]}, "
          f"catch_up {[t.strftime('%H:%M:%S') for t in after['tick_all']]}")
    assert [t for t in after["tick"] if t <= missed[-1]] == [missed[-1]]
    assert [t for t in after["tick_all"] if t <= missed[-1]] == missed


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"cron": "61 * * * *"}, "cron='61 * * * *' is invalid (bad minute)"),
    ({"cron": "* * *"}, "has 3 field(s)"),
    ({"cron": "* * * * * * *"}, "has 7 field(s)"),
    ({"cron": "@fortnightly"}, "unknown shortcut"),
    ({"cron": "0 0 30 2 *"}, "cron='0 0 30 2 *'"),
    ({"cron": ""}, "use a cron expression"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus_Mons"}, "not a known IANA timezone"),
    ({"cron": "0 3 * * *", "timezone": "../etc/passwd"}, "not a known IANA timezone"),
    ({"every": 60, "timezone": "Europe/Paris"}, "with every=: intervals tick at multiples"),
    ({"every": 60, "timezone": "Nowhere/Else"}, "not a known IANA timezone"),
    ({"every": 0.5}, "shorter than 1 s"),
    ({"every": timedelta(milliseconds=10)}, "shorter than 1 s"),
    ({"every": float("nan")}, "use a number of seconds"),
    ({"every": "60"}, "use a number of seconds"),
    ({"cron": "0 3 * * *", "every": 60}, "exactly one of cron= "),
    ({}, "exactly one of cron= "),
    ({"every": 60, "name": ""}, "schedule name ''"),
    ({"every": 60, "queue": ""}, "queue ''"),
    ({"every": 60, "max_attempts": 0}, "max_attempts=0"),
    ({"every": 60, "catch_up": "yes"}, "catch_up='yes'"),
])
def test_bad_schedules_are_refused_at_registration(kwargs: dict[str, object],
                                                   needle: str) -> None:
    q = Queue("postgresql://unused", schema="unused")
    with pytest.raises(ConfigurationError) as e:
        q.periodic("t", **kwargs)  # type: ignore[arg-type]
    assert needle.lower() in str(e.value).lower()
    assert q.schedules == {}


async def test_more_refusals_at_registration_and_at_worker_start(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    queue.periodic("t", every=60, name="twice")
    with pytest.raises(ConfigurationError, match="schedule 'twice' is registered twice"):
        queue.periodic("t", cron="@daily", name="twice")
    with pytest.raises(InvalidPayloadError, match="payload"):
        queue.periodic("t", every=60, name="p", payload={"s": {1, 2}})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="without cron="):
        queue.task(name="zoned", timezone="Europe/Paris")(noop)
    with pytest.raises(ConfigurationError, match="hour"):
        queue.task(name="nightly", cron="0 25 * * *")(noop)
    assert "nightly" not in queue.tasks and "nightly" not in queue.schedules
    queue.task(name="daily", cron="@daily")(noop)
    with pytest.raises(ConfigurationError, match="schedule 'daily' is registered twice"):
        queue.periodic("daily", every=60)
    # The task of "twice" is registered nowhere: refused when a worker starts, not before.
    with pytest.raises(ConfigurationError, match="enqueues task 't', which is not registered"):
        queue.check_schedules()
    with pytest.raises(ConfigurationError, match="not registered"):
        await Worker(queue).run()
    # Registered later (after periodic()), it is fine.
    queue.task(name="t")(noop)
    assert [s.name for s in queue.check_schedules()] == ["twice", "daily"]
    monkeypatch.setitem(sys.modules, "cronsim", None)  # the cron extra not installed
    with pytest.raises(ConfigurationError, match=r"pip install asyncjobq\[cron\]"):
        queue.periodic("t", cron="0 3 * * *", name="x")
    queue.periodic("t", every=60, name="x")  # every= needs no extra


@pytest.mark.parametrize(("case", "needle"), [
    ("expression", "cron='61 * * * *' is invalid"),
    ("fields", "has 3 field(s)"),
    ("timezone", "timezone='Mars/Olympus_Mons' is not a known IANA timezone"),
    ("every", "shorter than 1 s"),
    ("both", "exactly one of"),
    ("neither", "exactly one of"),
    ("duplicate", "schedule 'twice' is registered twice"),
    ("unknown-task", "enqueues task 'no_such_task', which is not registered"),
    ("decorator", "cron='0 25 * * *' is invalid"),
])
@pytest.mark.parametrize("command", ["schedules", "worker"])
@pytest.mark.processes
def test_the_cli_refuses_bad_schedules_in_one_line(pg_dsn: str, case: str, needle: str,
                                                   command: str) -> None:
    r = run_cli(command, "apps.badschedule:queue", dsn=pg_dsn, env={"ASYNCJOBQ_TEST_BAD": case},
                timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("asyncjobq: error: apps.badschedule:queue: "), lines
    assert needle.lower() in lines[0].lower(), lines


# --- the schedules command ---------------------------------------------------------------------


@pytest.mark.processes
async def test_schedules_command_lists_name_task_expression_timezone_ticks(
        queue: Queue, pg_dsn: str) -> None:
    env = {"ASYNCJOBQ_TEST_SCHEMA": queue.schema}
    # The command computes next_tick somewhere between these two instants; the subprocess
    # takes long enough that the tick may already have passed by the time it returns.
    before = datetime.now(UTC)
    r = run_cli("schedules", "apps.periodicapp:queue", "--json", dsn=pg_dsn, env=env)
    after = datetime.now(UTC)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"every-second", "cron-2s"}
    assert rows["cron-2s"]["last_tick"] is None
    assert rows["cron-2s"]["expression"] == "*/2 * * * * *"
    assert rows["cron-2s"]["timezone"] == "Europe/Paris"
    assert rows["cron-2s"]["task"] == "cron_2s"
    assert rows["every-second"]["expression"] == "every 1s"
    assert rows["every-second"]["payload"] == {"from": "every"}
    nxt = datetime.fromisoformat(rows["cron-2s"]["next_tick"])
    assert before < nxt <= after + timedelta(seconds=2) and nxt.second % 2 == 0
    await execute(queue, "INSERT INTO {s}.periodic_ticks (name, tick) VALUES"
                  " ('every-second', date_trunc('second', now()) + interval '1 h')")
    r = run_cli("schedules", "apps.periodicapp:queue", "--json", dsn=pg_dsn, env=env)
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    last = datetime.fromisoformat(rows["every-second"]["last_tick"])
    assert datetime.fromisoformat(rows["every-second"]["next_tick"]) == last + timedelta(
        seconds=1)
    r = run_cli("schedules", "apps.periodicapp:queue", dsn=pg_dsn,
                env={**env, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "every-second" in r.stdout and "*/2 * * * * *" in r.stdout
    assert "Europe/Paris" in r.stdout and last.isoformat() in r.stdout
    r = run_cli("status", "--json", "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["schedules"] == {"every-second": last.isoformat()}


@pytest.mark.processes
def test_the_readme_example_lists_its_schedules(pg_dsn: str, schema: str) -> None:
    """examples/periodic.py (docs/guides/periodic.md), listed as its docstring says, from the
    repository's root."""

    def schedules() -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "ASYNCJOBQ_DSN": pg_dsn, "QUEUE_SCHEMA": schema}
        return subprocess.run([sys.executable, "-m", "asyncjobq", "schedules",
                               "examples.periodic:queue", "--json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    r = schedules()
    assert r.returncode == 1 and "is not installed" in r.stderr, r.stderr  # loaded and checked
    assert run_cli("install", "--schema", schema, dsn=pg_dsn).returncode == 0
    r = schedules()
    assert r.returncode == 0, r.stderr
    assert [(s["name"], s["task"], s["expression"], s["timezone"], s["payload"])
            for s in json.loads(r.stdout)] == [
        ("nightly_report", "nightly_report", "0 3 * * *", "Europe/Paris", {}),
        ("tmp-cleanup", "cleanup", "every 30s", "UTC", {"scope": "tmp"}),
        ("cache-cleanup", "cleanup", "*/15 * * * *", "UTC", {"scope": "cache"})]


# --- cost ----------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_thousand_schedules_turn_time(queue: Queue) -> None:
    """The leader's turn with 1,000 schedules: all due at every turn (every second), and none
    due (daily crons); the event loop's longest stall during the turns shows what claims
    would wait. Figures printed; no timed assertion."""
    queue.task(name="t")(noop)
    for i in range(1000):
        queue.periodic("t", every=1, name=f"s{i}")
    busy = scheduler(queue)
    queue.schedules.clear()
    for i in range(1000):
        queue.periodic("t", cron=f"{i % 60} {i % 24} * * *", timezone="Europe/Paris",
                       name=f"c{i}")
    idle = scheduler(queue)
    stalls: list[float] = []
    stop = asyncio.Event()

    async def watch_loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - t - 0.001)

    watcher = asyncio.create_task(watch_loop())
    base = utc(2026, 6, 1, 12, 0, 0, 200_000)
    report = []
    try:
        for label, sched, step in (("all 1,000 due", busy, 1.0), ("none due", idle, 1.0)):
            await sched.turn(now=base)  # first sight: where each schedule starts
            totals: list[float] = []
            parts: list[dict[str, float]] = []
            enqueued: list[int] = []
            stalls.clear()
            for k in range(1, 11):
                enqueued.append(await sched.turn(now=base + timedelta(seconds=step * k)))
                totals.append(sched.last_turn["total"])
                parts.append(sched.last_turn)
            def ms(part: str, parts: list[dict[str, float]] = parts) -> str:
                return f"{statistics.median(p[part] for p in parts) * 1000:.1f}"

            report.append(
                f"{label}: turn median {ms('total')} ms, max {max(totals) * 1000:.1f} ms "
                f"(read {ms('read')}, compute {ms('compute')}, write {ms('write')} ms); jobs "
                f"per turn {statistics.median(enqueued):.0f}; longest event-loop stall "
                f"{max(stalls) * 1000:.1f} ms")
            if sched is busy:
                assert enqueued == [1000] * 10
            else:
                assert enqueued == [0] * 10
    finally:
        stop.set()
        await watcher
    print("\n" + "\n".join(report))
