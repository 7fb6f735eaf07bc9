"""One attempt at a time: sync bodies past their timeout, attempts fenced in heartbeats, claims
whose reply was lost, a heartbeat that hangs or fails, and wake-ups for every due time."""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
import time
from typing import Any

import psycopg
import pytest
from conftest import execute, fetchval, running, spawn_worker, wait_for

from asyncjobq import Fail, Job, Queue, Retry, Worker


async def status_of(queue: Queue, job_id: int) -> str | None:
    info = await queue.get(job_id)
    return None if info is None else info.status


class Bodies:
    """Start and end of every handler body, from whichever thread runs it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[int, float, float]] = []  # attempt, start, end (epoch)
        self.now = 0
        self.peak = 0

    def enter(self) -> float:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        return time.time()

    def leave(self, attempt: int, started: float) -> None:
        with self.lock:
            self.now -= 1
            self.spans.append((attempt, started, time.time()))


async def test_sync_handler_past_its_timeout_never_overlaps_its_next_attempt(
        queue: Queue) -> None:
    bodies = Bodies()

    @queue.task(name="stubborn", timeout=0.3, max_attempts=3, backoff=lambda a: 0)
    def stubborn(job: Job) -> None:
        started = bodies.enter()
        try:
            time.sleep(1.2)  # ignores the timeout: a thread cannot be interrupted
        finally:
            bodies.leave(job.attempt, started)

    job_id = await stubborn.enqueue({})
    w = Worker(queue, concurrency=1, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: len(bodies.spans) == 3, timeout=30, what="three attempts")
        await wait_for(lambda: status_of(queue, job_id), timeout=10)
        await wait_for(lambda: _is(queue, job_id, "failed"), timeout=10, what="job failed")
    assert bodies.peak == 1, f"{bodies.peak} bodies of the job ran at once"
    spans = sorted(bodies.spans, key=lambda s: s[1])
    assert [a for a, _, _ in spans] == [1, 2, 3]
    for (_, _, end), (_, start, _) in itertools.pairwise(spans):
        assert start >= end, "an attempt started while the previous body still ran"
    finished = await fetchval(queue, "SELECT extract(epoch FROM finished_at) FROM {s}.jobs"
                              " WHERE id = %s", job_id)
    assert float(finished) >= spans[-1][2] - 0.05, "failed while its last body still ran"
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 3
    assert info.last_error is not None and info.last_error.count("timed out after 0.3 s") == 3


async def _is(queue: Queue, job_id: int, status: str) -> bool:
    return await status_of(queue, job_id) == status


async def test_sync_bodies_hold_their_slots_so_concurrency_bounds_them(queue: Queue) -> None:
    bodies = Bodies()

    @queue.task(name="overrun", timeout=0.1, max_attempts=1)
    def overrun(job: Job) -> None:
        started = bodies.enter()
        try:
            time.sleep(0.6)
        finally:
            bodies.leave(job.attempt, started)

    await queue.enqueue_many("overrun", [{} for _ in range(6)])
    async with running(Worker(queue, concurrency=2, poll_interval=0.1)):
        await wait_for(lambda: len(bodies.spans) == 6, timeout=30, what="six bodies")
    assert bodies.peak == 2


@pytest.mark.timeout(120)
@pytest.mark.processes
async def test_sigterm_with_a_sync_body_that_will_not_return(queue: Queue, pg_dsn: str) -> None:
    """The worker exits within shutdown_timeout + a few seconds; the job, whose body was still
    running when the process went, is not handed back as queued: the reaper takes it later."""
    await execute(queue, "CREATE TABLE {s}.claims (job_id bigint, attempt int, pid int,"
                  " worker text, at timestamptz DEFAULT clock_timestamp())")
    job_id = await queue.enqueue("block_sync", {"seconds": 60})
    proc = spawn_worker(pg_dsn, queue.schema, "--shutdown-timeout", "1")
    try:
        await wait_for(lambda: fetchval(queue, "SELECT count(*) = 1 FROM {s}.claims"),
                       timeout=30, what="the sync body running")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert took < 1 + 5 + 6, f"exited {took:.1f} s after SIGTERM"
    assert "Traceback" not in err
    assert "leaving their jobs to be reaped after the lease" in err
    assert await status_of(queue, job_id) == "running"
    assert await fetchval(queue, "SELECT attempts FROM {s}.jobs WHERE id = %s", job_id) == 1


async def test_a_reaped_job_claimed_again_by_the_same_worker_cancels_the_old_attempt(
        queue: Queue) -> None:
    """The heartbeat is fenced on attempts: attempt 1, reaped while this worker could still
    claim, is cancelled when attempt 2 (claimed by this same worker) is found in its place."""
    started: list[int] = []
    cancelled: list[int] = []
    release = asyncio.Event()

    @queue.task(name="twice", max_attempts=3)
    async def twice(job: Job) -> None:
        started.append(job.attempt)
        if job.attempt == 1:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(job.attempt)
                raise
        await release.wait()

    job_id = await twice.enqueue({})
    w = Worker(queue, concurrency=4, lease=3.0, poll_interval=0.1, reap_interval=0.1)
    async with running(w):
        await wait_for(lambda: started == [1], timeout=10, what="attempt 1 running")
        # Attempt 1's lease runs out as if its heartbeats had stalled: the reaper (this
        # worker's own) requeues it and this same worker claims attempt 2.
        await execute(queue, "UPDATE {s}.jobs SET locked_at = now() - interval '1 hour'"
                      " WHERE id = %s", job_id)
        await wait_for(lambda: started == [1, 2], timeout=10, what="attempt 2 running")
        assert len(w.running_jobs) == 2  # both counted against the slots
        await wait_for(lambda: cancelled == [1], timeout=10, what="attempt 1 cancelled")
        assert [j.attempt for j in w.running_jobs] == [2]
        assert w.heartbeat is not None
        beats = w.heartbeat.beats
        await wait_for(lambda: w.heartbeat is not None and w.heartbeat.beats > beats + 1,
                       timeout=10, what="heartbeats of attempt 2")
        locked_at_age = await fetchval(queue, "SELECT extract(epoch FROM now() - locked_at)"
                                       " FROM {s}.jobs WHERE id = %s", job_id)
        assert float(locked_at_age) < 3.0  # attempt 2 is heartbeated
        release.set()
        await wait_for(lambda: _is(queue, job_id, "done"), timeout=10, what="attempt 2 done")
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 2
    assert w.completed == 1


@pytest.mark.parametrize("path", ["fetch", "flush"])
async def test_a_claim_whose_reply_is_lost_is_released_without_counting_an_attempt(
        queue: Queue, path: str) -> None:
    """The claim commits, then its connection dies before the rows arrive: the rows are held
    by this worker in the table with no handler. They go back to queued, attempt uncounted,
    and run; a max_attempts=1 job is not dead-lettered without ever running."""
    ran: list[tuple[str, int]] = []
    gate = asyncio.Event()

    @queue.task(name="once", max_attempts=1)
    async def once(job: Job) -> None:
        ran.append((job.payload["name"], job.attempt))
        if job.payload["name"] == "first":
            await gate.wait()

    w = Worker(queue, concurrency=1, batch_size=1, lease=60.0, poll_interval=0.2)
    lost = {"n": 0}
    async with running(w):
        assert w.fetcher is not None and w.completer is not None
        fetcher, completer = w.fetcher, w.completer
        real_claim = fetcher.claim
        if path == "fetch":
            calls = {"n": 0}

            async def claim_reply_lost(limit: int) -> list[Job]:
                calls["n"] += 1
                jobs = await real_claim(limit)
                if jobs and not lost["n"]:
                    lost["n"] += 1
                    raise psycopg.OperationalError("server closed the connection unexpectedly")
                return jobs

            fetcher.claim = claim_reply_lost  # type: ignore[method-assign]
            # A claim sent before the patch (the first, while the fetcher's connection opens)
            # would take the victim unharmed: enqueue once the patched claim has run.
            fetcher.wakeup.set()
            await wait_for(lambda: calls["n"] > 0, timeout=10, what="a patched claim")
            job_id = await once.enqueue({"name": "victim"})
        else:
            # The fetcher claims only the first job; the victim is claimed by the flush of the
            # first job's outcome, whose reply is lost.
            async def first_claim_only(limit: int) -> list[Job]:
                return await real_claim(limit) if not ran or lost["n"] else []

            fetcher.claim = first_claim_only  # type: ignore[method-assign]

            async def flush_reply_lost(conn: Any, params: Any, claim: Any) -> set[int]:
                rows = await (await conn.execute(claim.query,
                                                 {**params, **claim.params})).fetchall()
                if any(r[0] for r in rows) and not lost["n"]:
                    lost["n"] += 1
                    raise psycopg.OperationalError("server closed the connection unexpectedly")
                return _accept(fetcher, rows, claim)

            completer._set_outcomes_then_claim = flush_reply_lost  # type: ignore[method-assign]
            first = await once.enqueue({"name": "first"})
            await wait_for(lambda: ran == [("first", 1)], timeout=10, what="first job running")
            job_id = await once.enqueue({"name": "victim"})
            gate.set()
            await wait_for(lambda: _is(queue, first, "done"), timeout=10, what="first done")
        await wait_for(lambda: _is(queue, job_id, "done"), timeout=15, what="victim done")
    assert lost["n"] == 1
    assert ("victim", 1) in ran
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 1 and info.last_error is None
    assert w.fetcher is not None and w.fetcher.released == 1


def _accept(fetcher: Any, rows: list[Any], claim: Any) -> set[int]:
    fetcher.folded_claimed([r[1:] for r in rows if r[0] is not False], claim)
    return {int(r[1]) for r in rows if r[0] is False}


async def test_a_hanging_heartbeat_is_bounded_and_cut_off_handlers_are_cancelled(
        queue: Queue, pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A beat blocked on a row lock ends at the heartbeat's statement timeout instead of
    hanging; once no beat has landed for the lease, the worker cancels its handlers (the fleet
    presumes it dead); the heartbeat thread lives on and beats again afterwards."""
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    outcomes: list[str] = []

    @queue.task(name="long", max_attempts=3)
    async def long(job: Job) -> None:
        try:
            await asyncio.sleep(60 if job.attempt == 1 else 0)
        except asyncio.CancelledError:
            outcomes.append(f"cancelled {job.attempt}")
            raise
        outcomes.append(f"done {job.attempt}")

    job_id = await long.enqueue({})
    w = Worker(queue, concurrency=2, lease=1.5, poll_interval=0.1, reap_interval=0.2)
    async with running(w):
        await wait_for(lambda: _is(queue, job_id, "running"), timeout=10, what="job running")
        assert w.heartbeat is not None
        hb = w.heartbeat
        with psycopg.connect(pg_dsn) as blocker:
            # Holds the row so that the heartbeat's UPDATE waits for it (and so that the
            # reaper, SKIP LOCKED, cannot take it meanwhile).
            blocker.execute(f'SELECT 1 FROM "{queue.schema}".jobs WHERE id = %s FOR UPDATE',
                            (job_id,))
            failures = hb.failures
            await wait_for(lambda: hb.failures > failures, timeout=10,
                           what="a beat ended by its statement timeout")
            await wait_for(lambda: outcomes == ["cancelled 1"], timeout=10,
                           what="the cut-off handler cancelled")
            blocker.rollback()
        assert hb.alive
        # The job, running in the table with no handler, is reaped and runs again.
        await wait_for(lambda: _is(queue, job_id, "done"), timeout=20, what="job done")
        assert outcomes == ["cancelled 1", "done 2"]
        assert hb.alive
    assert "canceling statement due to statement timeout" in caplog.text
    assert "presuming the lease lost" in caplog.text


async def test_the_heartbeat_thread_survives_any_exception(queue: Queue) -> None:
    @queue.task(name="slow")
    async def slow(job: Job) -> None:
        await asyncio.sleep(4)

    job_id = await slow.enqueue({})
    # The beat after the error connects again: a lease of 2 s leaves it room on a loaded
    # machine (the lease is watched while it connects).
    w = Worker(queue, lease=2, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: _is(queue, job_id, "running"), timeout=10)
        assert w.heartbeat is not None
        hb = w.heartbeat
        real = hb._renew
        calls = {"n": 0}

        def flaky() -> list[tuple[int, int]]:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a bug somewhere in the worker")
            return real()

        hb._renew = flaky  # type: ignore[method-assign]
        await wait_for(lambda: calls["n"] >= 1, timeout=5)
        beats = hb.beats
        await wait_for(lambda: hb.beats > beats, timeout=5, what="a beat after the error")
        assert hb.alive
        await wait_for(lambda: _is(queue, job_id, "done"), timeout=10)
    assert w.reaper is not None and w.reaper.reaped == 0


async def test_every_pending_due_time_wakes_the_fetcher(queue: Queue) -> None:
    ran: dict[str, float] = {}

    @queue.task(name="later")
    async def later(job: Job) -> None:
        ran[job.payload["n"]] = time.monotonic()

    w = Worker(queue, poll_interval=30)
    async with running(w):
        await wait_for(lambda: w.listener is not None and w.listener.connected.is_set())
        t0 = time.monotonic()
        await later.enqueue({"n": "a"}, delay=0.5)
        await later.enqueue({"n": "b"}, delay=1.0)
        await later.enqueue({"n": "c"}, delay=1.5)
        await wait_for(lambda: len(ran) == 3, timeout=10, what="all three delayed jobs")
    assert ran["c"] - t0 < 5, "a later due time waited for the next poll"


async def test_a_timed_out_sync_body_still_running_at_shutdown_fails_as_timed_out(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    """The timeout fired, the worker waited for the body, and a stop cancelled it meanwhile:
    the attempt timed out (counted, failed here), it was not interrupted by the shutdown
    (requeued at once, uncounted in effect)."""
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    started = threading.Event()

    @queue.task(name="overrun_at_stop", timeout=0.3, max_attempts=1)
    def overrun_at_stop(job: Job) -> None:
        started.set()
        time.sleep(1.5)

    seen = _Outcomes()
    queue.add_hook(seen)
    job_id = await overrun_at_stop.enqueue({})
    w = Worker(queue, concurrency=1, poll_interval=0.1, shutdown_timeout=0.3)
    async with running(w):
        await wait_for(started.is_set, timeout=10, what="the body running")
        await wait_for(lambda: "cannot be interrupted" in caplog.text, timeout=10,
                       what="the timeout fired, the worker waiting for the body")
    info = await queue.get(job_id)
    assert info is not None and info.status == "failed", info
    assert info.last_error is not None and "timed out after 0.3 s" in info.last_error
    await wait_for(lambda: bool(seen.outcomes), timeout=10, what="on_finished")
    assert seen.outcomes == ["failed"], "a timed-out attempt was reported as cancelled"


class _Outcomes:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    async def on_finished(self, **kw: Any) -> None:
        self.outcomes.append(kw["outcome"])


async def test_a_sync_body_that_returns_while_shutdown_waits_is_done_not_run_again(
        queue: Queue) -> None:
    """The shutdown cancels a sync body it cannot interrupt and waits for it; the body then
    returns: the job is done. Released as interrupted, it would run a second time."""
    started = threading.Event()
    bodies: list[int] = []
    seen = _Outcomes()
    queue.add_hook(seen)

    @queue.task(name="finishes_at_stop")
    def finishes_at_stop(job: Job) -> None:
        started.set()
        time.sleep(1.0)
        bodies.append(job.attempt)

    job_id = await finishes_at_stop.enqueue({})
    w = Worker(queue, concurrency=1, poll_interval=0.1, shutdown_timeout=0.2)
    async with running(w):
        await wait_for(started.is_set, timeout=10, what="the body running")
    info = await queue.get(job_id)
    assert bodies == [1]
    assert info is not None and info.status == "done", info
    await wait_for(lambda: bool(seen.outcomes), timeout=10, what="on_finished")
    assert seen.outcomes == ["done"]


@pytest.mark.parametrize("turns_into", ["Fail", "Retry", "error", "return"])
async def test_a_handler_that_turns_a_lost_lease_into_an_outcome_writes_nothing(
        queue: Queue, turns_into: str) -> None:
    """Cancelled for a lost lease, a handler that answers with a Fail, a Retry, an error of its
    own or a plain return must not have it written: another attempt may hold the row."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    @queue.task(name="stubborn_async", max_attempts=1)
    async def stubborn_async(job: Job) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            if turns_into == "Fail":
                raise Fail("gave up") from None
            if turns_into == "Retry":
                raise Retry(0) from None
            if turns_into == "error":
                raise RuntimeError("cleanup failed") from None

    job_id = await stubborn_async.enqueue({})
    w = Worker(queue, concurrency=1, lease=60.0, poll_interval=0.1)
    async with running(w):
        # Its body, not only its task: a task cancelled before its first step never sees the
        # CancelledError this test is about (a CI run under load hit that).
        await wait_for(started.is_set, timeout=10, what="the handler running")
        w._running.lease_lost(set(w._running.leased()))
        await wait_for(cancelled.is_set, timeout=10, what="the handler cancelled")
        await wait_for(lambda: not w._running, timeout=10, what="the handler ended")
        await wait_for(lambda: w.completer is not None and not w.completer.pending(),
                       timeout=10, what="nothing left to write")
        row = await fetchval(queue, "SELECT status || ':' || attempts FROM {s}.jobs"
                             " WHERE id = %s", job_id)
        assert row == "running:1", "an outcome of a handler whose lease was lost was written"
        await execute(queue, "DELETE FROM {s}.jobs WHERE id = %s", job_id)


async def test_a_cut_off_job_is_left_to_the_reaper_not_released_uncounted(
        queue: Queue) -> None:
    """A handler given up because no heartbeat landed for a lease leaves its row running under
    this worker; a release of lost claim rows must leave that row alone (the reaper takes it,
    counting the attempt), or a job always cut off would run forever."""
    gate = asyncio.Event()

    @queue.task(name="cut", max_attempts=1)
    async def cut(job: Job) -> None:
        await gate.wait()

    job_id = await cut.enqueue({})
    w = Worker(queue, concurrency=1, lease=60.0, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: bool(w._running), timeout=10, what="the job running")
        (r,) = w._running
        r.started -= 120  # its lease ran out as far as the worker can tell
        w._running.cut_off(120.0)
        await wait_for(lambda: not w._running, timeout=10, what="the handler cancelled")
        assert w.fetcher is not None
        w.fetcher._suspect = True  # a claim's reply was lost meanwhile
        w.fetcher.wakeup.set()
        await wait_for(lambda: w.fetcher is not None and not w.fetcher._suspect, timeout=10,
                       what="the lost claim rows released")
        assert w.fetcher.released == 0
        row = await fetchval(queue, "SELECT status || ':' || attempts FROM {s}.jobs"
                             " WHERE id = %s", job_id)
        assert row == "running:1"
        gate.set()


@pytest.mark.parametrize("reason", ["lease lost", "shutdown"])
async def test_a_job_cancelled_before_its_task_starts_frees_its_slot(
        queue: Queue, reason: str) -> None:
    """A cancel that lands between a job's dispatch and its task's first step (a loaded loop
    runs other callbacks first) is thrown into the coroutine before any of its code: the job
    stayed in the running set for ever, its slot taken and its row renewed by the heartbeat
    though no handler ran (a CI run under load timed out on it). Now the handler never starts,
    the slot comes back, and the job goes the way its reason says."""
    ran: list[int] = []

    @queue.task(name="early", max_attempts=3)
    async def early(job: Job) -> None:
        ran.append(job.id)

    job_id = await early.enqueue({})
    w = Worker(queue, concurrency=1, poll_interval=0.1)
    dispatch = w._running.dispatch
    dispatched: list[int] = []

    def dispatch_then_cancel(job: Job) -> None:
        dispatch(job)
        dispatched.append(job.id)
        r = w._running.get((job.id, job.attempt))
        assert r is not None
        r.cancel(reason)  # before the task's first step

    w._running.dispatch = dispatch_then_cancel  # type: ignore[method-assign]
    async with running(w):
        await wait_for(lambda: bool(dispatched), timeout=10, what="the job claimed")
        await wait_for(lambda: not w._running, timeout=10, what="its slot freed")
        if reason == "shutdown":
            # Released uncounted as interrupted, and claimed (and cancelled) again.
            await wait_for(lambda: fetchval(queue, "SELECT attempts > 1 OR status = 'queued'"
                                            " FROM {s}.jobs WHERE id = %s", job_id),
                           timeout=10, what="the job released")
    assert ran == []
    if reason == "lease lost":  # nothing written: the reaper takes it, its attempt counted
        row = await fetchval(queue, "SELECT status || ':' || attempts FROM {s}.jobs"
                             " WHERE id = %s", job_id)
        assert row == "running:1"


async def test_a_job_whose_claim_reply_is_always_lost_is_not_claimed_for_ever(
        queue: Queue) -> None:
    """Released uncounted after each lost reply, a row whose reply never arrives would be
    claimed for ever: from the third lost reply in a row its attempt is counted, and with its
    attempts spent it fails."""
    ran: list[int] = []

    @queue.task(name="unreachable", max_attempts=1)
    async def unreachable(job: Job) -> None:
        ran.append(job.id)

    w = Worker(queue, concurrency=2, poll_interval=0.1)
    claims = {"n": 0, "calls": 0}
    async with running(w):
        fetcher = w.fetcher
        assert fetcher is not None
        real_claim = fetcher.claim

        async def claim_reply_always_lost(limit: int) -> list[Job]:
            claims["calls"] += 1
            jobs = await real_claim(limit)
            if jobs:
                claims["n"] += 1
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return jobs

        fetcher.claim = claim_reply_always_lost  # type: ignore[method-assign]
        # A claim sent before the patch would take the job unharmed (it then runs, and is never
        # failed: a CI run under load waited 20 s for that): enqueue once the patch has run.
        fetcher.wakeup.set()
        await wait_for(lambda: claims["calls"] > 0, timeout=10, what="a patched claim")
        job_id = await unreachable.enqueue({})
        await wait_for(lambda: _is(queue, job_id, "failed"), timeout=20, what="the job failed")
        fetcher.claim = real_claim  # type: ignore[method-assign]
    assert claims["n"] == 3 and ran == []
    assert fetcher.released == 2
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 1
    assert info.last_error is not None and "lost with the connection 3 times" in info.last_error


async def test_jobs_claimed_beside_one_whose_reply_is_always_lost_are_not_charged(
        queue: Queue) -> None:
    """A lost reply of a batch is no one row's doing: the batch is released uncounted and its
    rows are claimed one at a time, so only the row whose reply never arrives is charged."""
    ran: list[int] = []

    @queue.task(name="fragile", max_attempts=1)
    async def fragile(job: Job) -> None:
        ran.append(job.id)

    w = Worker(queue, concurrency=4, poll_interval=0.1)
    calls: list[int] = []
    async with running(w):
        fetcher = w.fetcher
        assert fetcher is not None
        real_claim = fetcher.claim

        async def claim_reply_lost_with_the_victim(limit: int) -> list[Job]:
            calls.append(limit)
            jobs = await real_claim(limit)
            if any(j.payload.get("victim") for j in jobs):
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return jobs

        fetcher.claim = claim_reply_lost_with_the_victim  # type: ignore[method-assign]
        fetcher.wakeup.set()
        await wait_for(lambda: bool(calls), timeout=10, what="a patched claim")
        # One statement: the victim (first in claim order) and its mates come due together.
        victim, *mates = await queue.enqueue_many("fragile", [{"victim": True}, {}, {}, {}])
        await wait_for(lambda: _is(queue, victim, "failed"), timeout=20, what="victim failed")
        await wait_for(lambda: sorted(ran) == sorted(mates), timeout=20, what="the mates ran")
        fetcher.claim = real_claim  # type: ignore[method-assign]
    for job_id in mates:
        info = await queue.get(job_id)
        assert info is not None and info.status == "done" and info.attempts == 1, info
