"""A worker whose event loop is blocked (heartbeat.py): under a lease its heartbeats go on and
it keeps its jobs; for a lease or more they stop, the fleet takes the jobs back and runs them
again, and when the loop returns the worker's late outcomes are refused. The log names the code
that blocks the loop."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, cast

import psycopg
import pytest
from conftest import running, wait_for
from psycopg import sql

from asyncjobq import Job, Queue, Worker, metrics
from asyncjobq._db.database import Database
from asyncjobq._worker import heartbeat
from asyncjobq._worker.heartbeat import Heartbeat


@asynccontextmanager
async def on_a_loop_of_its_own(make: Callable[[], Worker]) -> AsyncIterator[Worker]:
    """Runs the worker `make` builds on an event loop in a thread of its own: its loop can be
    blocked while the test's loop (and any worker on it) goes on."""
    made: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        async def serve() -> None:
            worker = make()
            made["worker"], made["loop"] = worker, asyncio.get_running_loop()
            async with worker.queue:
                ready.set()
                await worker.run()

        try:
            asyncio.run(serve())
        except BaseException as e:
            made["error"] = e
        finally:
            ready.set()

    thread = threading.Thread(target=main, name="blocked-worker-loop", daemon=True)
    thread.start()
    await wait_for(ready.is_set, timeout=20, what="the worker's own loop")
    worker = made.get("worker")
    if worker is None:
        raise AssertionError(f"the worker did not start: {made.get('error')!r}")
    try:
        yield worker
    finally:
        made["loop"].call_soon_threadsafe(worker.stop)
        await asyncio.to_thread(thread.join, 2 * worker.shutdown_timeout + 45)
        assert not thread.is_alive(), "the worker on its own loop did not stop"
        if "error" in made:
            raise made["error"]


def records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "asyncjobq.heartbeat" and r.levelno == level and text in r.getMessage()]


async def test_a_loop_blocked_for_a_lease_gives_its_jobs_back_to_the_fleet(
        queue: Queue, pg_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    lease = 2.0
    hog_started = threading.Event()
    block_began: list[datetime] = []
    cancelled_here: list[int] = []
    ran_elsewhere: list[tuple[str, int]] = []

    def blocked_worker() -> Worker:
        q = Queue(pg_dsn, schema=queue.schema)

        @q.task(name="hog")
        async def hog(job: Job) -> None:
            # Blocks this worker's loop until another worker has run the job, up to 30 s:
            # before heartbeat.py stopped beating for a blocked loop, it never was.
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                # Done, a job leaves the jobs table (for jobs_history).
                query = sql.SQL("SELECT now(), EXISTS (SELECT FROM {}.jobs WHERE id = %s)"
                                ).format(sql.Identifier(queue.schema))
                row = conn.execute(query, (job.id,)).fetchone()
                assert row is not None
                block_began.append(row[0])
                hog_started.set()
                deadline = time.monotonic() + 30
                while row[1] and time.monotonic() < deadline:
                    time.sleep(0.05)  # noqa: ASYNC251 - blocks the loop on purpose
                    row = conn.execute(query, (job.id,)).fetchone()
                    assert row is not None

        @q.task(name="patient")
        async def patient(job: Job) -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled_here.append(job.attempt)
                raise

        return Worker(q, lease=lease, concurrency=2, poll_interval=0.1, reap_interval=0.2)

    @queue.task(name="hog")
    async def hog(job: Job) -> None:
        ran_elsewhere.append(("hog", job.attempt))

    @queue.task(name="patient")
    async def patient(job: Job) -> None:
        ran_elsewhere.append(("patient", job.attempt))

    # One claim takes both: the patient job awaits, the hog then blocks the loop.
    patient_id = await patient.enqueue({}, priority=1)
    hog_id = await hog.enqueue({})
    async with on_a_loop_of_its_own(blocked_worker) as blocked:
        await wait_for(hog_started.is_set, timeout=20, what="the hog blocking its loop")
        last_beat: list[datetime] = []

        async def hog_done_and_last_beat() -> bool:
            async with queue.connection() as conn:
                cur = await conn.execute(sql.SQL(
                    "SELECT status, attempts, locked_by, locked_at FROM {}.jobs WHERE id = %s"
                ).format(sql.Identifier(queue.schema)), (hog_id,))
                row = await cur.fetchone()
            if row is not None:
                if row[1] == 1 and row[2] == blocked.id:
                    last_beat[:] = [row[3]]
                return False
            info = await queue.get(hog_id)
            return info is not None and info.status == "done"

        # Started now, this worker leads once the blocked one's leader row lapses, and reaps.
        async with running(Worker(queue, lease=lease, poll_interval=0.1, reap_interval=0.2)):
            await wait_for(hog_done_and_last_beat, timeout=20, interval=0.05,
                           what="the hog's job taken back and run by the other worker")
            await wait_for(lambda: sorted(ran_elsewhere) == [("hog", 2), ("patient", 2)],
                           timeout=20, what="the patient job run again by the other worker")
            # The loop is back: the hog's late outcome is refused, the patient handler (whose
            # lease lapsed while the loop was blocked) cancelled, and nothing of it written.
            assert blocked.completer is not None and blocked.heartbeat is not None
            await wait_for(lambda: blocked.completer is not None
                           and blocked.completer.refused == 1 and cancelled_here == [1],
                           timeout=20, what="the blocked worker letting its jobs go")
            await wait_for(lambda: blocked.heartbeat is not None
                           and not blocked.heartbeat.stalled, timeout=5,
                           what="the blocked worker's heartbeats resumed")
    assert blocked.completed == 0
    assert blocked.heartbeat is not None and blocked.heartbeat.stalls == 1
    for job_id in (hog_id, patient_id):
        info = await queue.get(job_id)
        assert info is not None and (info.status, info.attempts) == ("done", 2), info
        assert info.last_error is not None
        assert f"attempt 1: lease expired, worker {blocked.id} stopped heartbeating" \
            in info.last_error
    # Beats went on into the block (one lands every lease / 3) and stopped at a lease.
    held_for = (last_beat[0] - block_began[0]).total_seconds()
    assert lease / 3 <= held_for < lease + 0.5, held_for
    (stalled,) = records(caplog, logging.ERROR, "event loop blocked")
    assert "a job's handler at " in stalled and "tests/test_blocked_loop.py:" in stalled
    assert "in hog" in stalled, stalled
    assert "Heartbeats stop" in stalled and "plain `def`" in stalled
    assert records(caplog, logging.WARNING, "event loop running again")


async def test_a_loop_blocked_for_less_than_a_lease_keeps_its_jobs(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    lease = 4.0
    beats: list[int] = []

    @queue.task(name="brief_block")
    async def brief_block(job: Job) -> None:
        assert w.heartbeat is not None
        beats.append(w.heartbeat.beats)
        time.sleep(lease * 0.45)  # noqa: ASYNC251 - blocks the loop on purpose
        beats.append(w.heartbeat.beats)

    job_id = await brief_block.enqueue({})
    w = Worker(queue, lease=lease, poll_interval=0.1, reap_interval=0.2)

    await run_until_done(queue, w, job_id)
    assert beats[1] > beats[0], "no heartbeat while the loop was blocked"
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 1
    assert w.heartbeat is not None and w.heartbeat.stalls == 0
    assert w.reaper is not None and w.reaper.reaped == 0
    (warning,) = records(caplog, logging.WARNING, "event loop blocked")
    assert "a job's handler at tests/test_blocked_loop.py:" in warning, warning
    assert " in brief_block" in warning and "Heartbeats continue" in warning
    assert not records(caplog, logging.ERROR, "")


async def test_a_blocked_loop_is_blamed_on_the_code_blocking_it(
        queue: Queue, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not every block is a handler's: here the leader's depth sampler (_maintenance/sampler.py)
    calls a publisher that blocks the loop."""
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    collector = metrics.collector(queue)
    published = threading.Event()

    def slow_publish(counts: dict[str, dict[str, int]]) -> None:
        if not published.is_set():
            time.sleep(2.0)
            published.set()

    monkeypatch.setattr(collector, "set_depth", slow_publish)
    w = Worker(queue, lease=6.0, poll_interval=0.1)
    async with running(w):
        await wait_for(published.is_set, timeout=20, what="the sampler's blocking publish")
        await wait_for(lambda: w.heartbeat is not None and w.heartbeat.blocked_warnings == 1,
                       timeout=5, what="the warning")
    (warning,) = records(caplog, logging.WARNING, "event loop blocked")
    assert "by asyncjobq's maintenance code at tests/test_blocked_loop.py:" in warning, warning
    assert "in slow_publish (called from _maintenance/sampler.py:" in warning, warning
    assert "handler" not in warning and "report it" in warning
    assert w.heartbeat is not None and w.heartbeat.stalls == 0


def a_heartbeat(lease: float = 3.0, **kw: Any) -> Heartbeat:
    """A Heartbeat that never reaches a database: nothing is held, so no beat connects."""
    return Heartbeat(cast(Database, None), "w", lease=lease, renew=list, running_tasks=list,
                     on_lost=lambda _: None, **kw)


@pytest.mark.parametrize("filename", ["", "<string>", "<frozen importlib._bootstrap>",
                                      "rel.py", "a/b/c.py", "/"])
def test_short_names_any_filename(filename: str) -> None:
    assert isinstance(heartbeat._short(filename), str)
    assert heartbeat._short("/x/y/z.py") == os.path.join("y", "z.py")


def test_blocker_names_code_compiled_without_a_filename(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # compile(src, "", "exec") gives frames whose filename is "": Path("").parts is empty.
    stop = threading.Event()
    code = compile("while not stop.is_set():\n    time.sleep(0.01)\n", "", "exec")
    thread = threading.Thread(target=exec, args=(code, {"stop": stop, "time": time}))
    thread.start()
    try:
        hb = a_heartbeat()
        hb._loop_thread = thread.ident
        where, advice = hb._blocker()
        assert where.startswith("code running on the loop at "), where
        assert "'':2 in <module>" in where, where
        assert "asyncio.to_thread" in advice
        # Whatever fails while locating the code, _blocker answers (its caller is the
        # heartbeat thread's every pass) and says why at DEBUG.
        caplog.set_level(logging.DEBUG, logger="asyncjobq.heartbeat")

        def broken(stack: object) -> str:
            raise RuntimeError("asyncjobq_never")

        monkeypatch.setattr(heartbeat, "_frames", broken)
        assert hb._blocker() == ("code that could not be located", "")
        assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records
                   if r.name == "asyncjobq.heartbeat")
    finally:
        stop.set()
        thread.join()


async def test_a_failing_watcher_neither_spins_nor_stops_the_beats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hb = a_heartbeat(lease=0.3)  # a beat due every 0.1 s: its time passes at once
    passes: list[str] = []

    def broken_watch() -> None:
        passes.append("watch_loop")
        raise RuntimeError("a bug in a watcher")

    def beat(conn: object) -> None:
        passes.append("beat")

    monkeypatch.setattr(hb, "_watch_loop", broken_watch)
    monkeypatch.setattr(hb, "_watch_lease", lambda: passes.append("watch_lease"))
    monkeypatch.setattr(hb, "_beat", beat)
    hb.start()
    try:
        await asyncio.sleep(1.0)
    finally:
        hb.stop()
    # A pass each TICK at most (0.1 s): before, a pass that raised came round again at once.
    assert passes.count("watch_loop") <= 1.0 / heartbeat.TICK + 3, len(passes)
    assert passes.count("watch_lease") >= 5 and passes.count("beat") >= 5, passes
    assert hb.failures == 0


async def test_a_loop_blocked_by_code_without_a_filename_keeps_beating(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    """Code compiled with filename "" blocks the loop for less than a lease: the warning
    names it, and the beats go on past the warning (before, naming it raised on every pass of
    the heartbeat thread, which then beat no more)."""
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    lease = 4.0  # warned after 1 s (heartbeat.py _watch_loop), a beat every 1.33 s
    samples: list[tuple[int, int]] = []  # (beats, blocked_warnings) while blocked
    code = compile("start = time.monotonic()\n"
                   "while time.monotonic() - start < 3.0:\n"
                   "    samples.append((hb.beats, hb.blocked_warnings))\n"
                   "    time.sleep(0.02)\n", "", "exec")

    @queue.task(name="anonymous_block")
    async def anonymous_block(job: Job) -> None:
        exec(code, {"time": time, "samples": samples, "hb": w.heartbeat})  # blocks the loop

    job_id = await anonymous_block.enqueue({})
    w = Worker(queue, lease=lease, poll_interval=0.1, reap_interval=0.2)

    await run_until_done(queue, w, job_id)
    assert w.heartbeat is not None
    assert w.heartbeat.failures == 0
    assert w.heartbeat.blocked_warnings == 1 and w.heartbeat.stalls == 0
    warned = [beats for beats, warnings in samples if warnings == 1]
    assert warned and warned[-1] > warned[0], f"no beat after the warning: {samples[-1]}"
    info = await queue.get(job_id)
    assert info is not None and info.attempts == 1
    (warning,) = records(caplog, logging.WARNING, "event loop blocked")
    assert re.search(r"a job's handler at '':[34] in <module> \(called from ", warning), warning
    assert "tests/test_blocked_loop.py:" in warning and "in anonymous_block" in warning
    assert not records(caplog, logging.WARNING, "heartbeat failed")


async def run_until_done(queue: Queue, w: Worker, job_id: int) -> None:
    """Run `w` until the job is done, then stop it."""

    async def done() -> bool:
        info = await queue.get(job_id)
        return info is not None and info.status == "done"

    async with running(w):
        await wait_for(done, timeout=20, what="the job done")
