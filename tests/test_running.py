"""The worker's running-job bookkeeping (_worker/running.py) on its own: no worker loop, no
database. Attempts run the worker's way (the executor, then finish()) on this test's loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from conftest import wait_for

from asyncjobq import Job, Queue
from asyncjobq._worker import running as running_module
from asyncjobq._worker.executor import RunningJob, execute
from asyncjobq._worker.outcome import Outcome
from asyncjobq._worker.running import LET_GO_LEASES, Key, Running
from asyncjobq._worker.threads import ThreadRunner

LEASE = 30.0
NOW = datetime.now(UTC)


def a_job(job_id: int, attempt: int = 1) -> Job:
    return Job(id=job_id, task="work", queue="default", payload={}, attempt=attempt,
               max_attempts=3, priority=0, run_at=NOW, created_at=NOW, worker="w")


class Clock:
    """running.py's monotonic clock, moved by hand: leases pass without waiting for them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Jobs:
    """A Running whose attempts run as the worker's _execute runs them."""

    def __init__(self) -> None:
        self.queue = Queue("postgresql://unused", schema="unused")
        self.gate = asyncio.Event()
        self.ran: list[Key] = []
        self.outcomes: dict[Key, Outcome | None] = {}
        self.pending: list[Key] = []  # outcomes not written yet, as the completer's
        self.runner = ThreadRunner("test-running")
        self.running = Running(self._execute, lease=LEASE, pending=lambda: list(self.pending))

        @self.queue.task(name="work")
        async def work(job: Job) -> None:
            self.ran.append((job.id, job.attempt))
            await self.gate.wait()

    async def _execute(self, running: RunningJob) -> None:
        running.begun = True
        outcome: Outcome | None = None
        try:
            outcome = await execute(running, self.queue.tasks.get(running.job.task),
                                    self.queue.tasks, self.runner)
        finally:
            self.outcomes[running.job.id, running.job.attempt] = outcome
            self.running.finish(running)

    def get(self, key: Key) -> RunningJob:
        r = self.running.get(key)
        assert r is not None, f"{key} is not running"
        return r

    async def started(self, *keys: Key) -> None:
        await wait_for(lambda: set(keys) <= set(self.ran), timeout=5, what=f"{keys} running")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(running_module, "time", c)
    return c


@pytest.fixture
def jobs() -> Iterator[Jobs]:
    j = Jobs()
    yield j
    j.gate.set()
    j.running.abandon_all()
    j.runner.close()


async def test_a_dispatched_job_runs_until_finish_frees_its_slot(jobs: Jobs) -> None:
    r = jobs.running
    r.dispatch(a_job(1))
    r.dispatch(a_job(2))
    assert len(r) == 2 and r
    assert [j.id for j in r.jobs()] == [1, 2]
    assert r.tasks() == ["work", "work"]
    assert r.describe() == "1 (work), 2 (work)"
    assert jobs.get((1, 1)).job.id == 1 and r.get((3, 1)) is None
    await jobs.started((1, 1), (2, 1))
    jobs.gate.set()
    await wait_for(lambda: not r, timeout=5, what="both finished")
    assert {k: o.kind if o else None for k, o in jobs.outcomes.items()} == {
        (1, 1): "done", (2, 1): "done"}
    assert r.jobs() == [] and r.leased() == [] and r.keep() == []


async def test_leased_is_what_runs_then_what_is_not_written(jobs: Jobs) -> None:
    jobs.pending[:] = [(7, 2)]
    jobs.running.dispatch(a_job(1))
    assert jobs.running.leased() == [(1, 1), (7, 2)]
    assert jobs.running.keep() == [(1, 1), (7, 2)]


async def test_two_attempts_of_one_job_are_counted_and_fenced_apart(jobs: Jobs) -> None:
    """After a lost lease the next attempt may be claimed here while the old one still runs."""
    r = jobs.running
    r.dispatch(a_job(1, attempt=1))
    r.dispatch(a_job(1, attempt=2))
    await jobs.started((1, 1), (1, 2))
    assert len(r) == 2
    r.lease_lost({(1, 1)})
    await wait_for(lambda: len(r) == 1, timeout=5, what="attempt 1 cancelled")
    assert jobs.get((1, 2)).cancel_reason is None
    assert r.leased() == [(1, 2)]
    assert r.keep() == [(1, 2), (1, 1)]


async def test_a_lost_lease_cancels_the_handler_lets_it_go_and_refuses_its_outcome(
        jobs: Jobs, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq.worker")
    r = jobs.running
    r.dispatch(a_job(1))
    r.dispatch(a_job(2))
    await jobs.started((1, 1), (2, 1))
    r.lease_lost({(1, 1), (99, 1)})  # 99: not running here, nothing to do
    assert jobs.get((1, 1)).cancel_reason == "lease lost"
    assert jobs.get((2, 1)).cancel_reason is None
    await wait_for(lambda: len(r) == 1, timeout=5, what="the handler cancelled")
    assert jobs.outcomes[1, 1] is None  # nothing written: another attempt may hold the row
    assert r.leased() == [(2, 1)]  # no longer renewed...
    assert r.keep() == [(2, 1), (1, 1)]  # ...nor released: the reaper's, its attempt counted
    assert "job 1 (work) attempt 1: lease lost (reaped while running)" in caplog.text
    jobs.gate.set()
    await wait_for(lambda: not r, timeout=5, what="job 2 done")
    outcome = jobs.outcomes[2, 1]
    assert outcome is not None and outcome.kind == "done"


async def test_a_lost_lease_leaves_a_handler_already_cancelled_alone(jobs: Jobs) -> None:
    """A shutdown's cancel keeps its reason: that job is released, not let go."""
    r = jobs.running
    r.dispatch(a_job(1))
    await jobs.started((1, 1))
    r.cancel_all("shutdown")
    r.lease_lost({(1, 1)})
    assert jobs.get((1, 1)).cancel_reason == "shutdown"
    await wait_for(lambda: not r, timeout=5, what="the handler cancelled")
    outcome = jobs.outcomes[1, 1]
    assert outcome is not None and outcome.kind == "retry" and outcome.delay == 0
    assert r.keep() == []


async def test_a_cut_off_cancels_only_the_handlers_whose_lease_ran_out(
        jobs: Jobs, clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq.worker")
    r = jobs.running
    r.dispatch(a_job(1))
    clock.now += LEASE / 2
    r.dispatch(a_job(2))  # claimed half a lease later: its row cannot have lapsed yet
    await jobs.started((1, 1), (2, 1))
    clock.now += LEASE / 2 + 1
    r.cut_off(LEASE + 1)
    assert jobs.get((1, 1)).cancel_reason == "lease lost"
    assert jobs.get((2, 1)).cancel_reason is None
    r.cut_off(LEASE + 1.1)  # again, a heartbeat TICK later: already cancelled, said once
    cut = [m for m in caplog.messages if "presuming the lease lost" in m]
    assert cut == ["job 1 (work) attempt 1: no heartbeat has reached the database for 31 s "
                   "(lease 30 s); presuming the lease lost and cancelling the handler"]
    await wait_for(lambda: len(r) == 1, timeout=5, what="the cut-off handler ended")
    assert jobs.outcomes[1, 1] is None
    assert r.keep() == [(2, 1), (1, 1)]


async def test_let_go_jobs_are_kept_from_a_release_for_ten_leases(
        jobs: Jobs, clock: Clock) -> None:
    """A let-go job's row is the reaper's, which takes it within a lease or two: for 10 leases
    a release of lost claim rows leaves it alone, then it is forgotten."""
    r = jobs.running
    r.dispatch(a_job(1))
    await jobs.started((1, 1))
    r.lease_lost({(1, 1)})
    await wait_for(lambda: not r, timeout=5, what="the handler cancelled")
    clock.now += LET_GO_LEASES * LEASE
    assert r.keep() == [(1, 1)]
    clock.now += 0.001
    assert r.keep() == []
    assert r.keep() == []


@pytest.mark.parametrize("reason", ["lease lost", "shutdown"])
async def test_a_job_cancelled_before_its_first_step_never_runs_and_frees_its_slot(
        jobs: Jobs, reason: str) -> None:
    """Cancelled before its task's first step, a task is thrown the cancellation before any of
    its code runs, so nothing would free its slot: cancel() only records the reason then."""
    r = jobs.running
    r.dispatch(a_job(1))
    running = jobs.get((1, 1))
    assert not running.begun
    if reason == "lease lost":
        r.lease_lost({(1, 1)})
    else:
        r.cancel_all(reason)
    assert running.task is not None and not running.task.cancelling()
    await wait_for(lambda: not r, timeout=5, what="its slot freed")
    assert jobs.ran == []
    outcome = jobs.outcomes[1, 1]
    if reason == "lease lost":  # the reaper's: nothing written, kept from a release
        assert outcome is None
        assert r.keep() == [(1, 1)]
    else:  # released as interrupted, its attempt not judged
        assert outcome is not None and (outcome.kind, outcome.delay) == ("retry", 0.0)
        assert outcome.error == "attempt 1: interrupted by worker shutdown"
        assert r.keep() == []


async def test_all_finished_waits_for_the_last_handler(jobs: Jobs) -> None:
    r = jobs.running
    await asyncio.wait_for(r.all_finished(), 1)  # none running: at once
    r.dispatch(a_job(1))
    r.dispatch(a_job(2))
    await jobs.started((1, 1), (2, 1))
    waiting = asyncio.create_task(r.all_finished())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    jobs.gate.set()
    await asyncio.wait_for(waiting, 5)
    assert not r


async def test_the_rest_cancelled_at_shutdown_are_released(jobs: Jobs) -> None:
    r = jobs.running
    r.dispatch(a_job(1))
    r.dispatch(a_job(2))
    await jobs.started((1, 1), (2, 1))
    r.cancel_all("shutdown")
    await asyncio.wait_for(r.all_finished(), 5)
    assert {k: (o.kind, o.error) if o else None for k, o in jobs.outcomes.items()} == {
        (1, 1): ("retry", "attempt 1: interrupted by worker shutdown"),
        (2, 1): ("retry", "attempt 1: interrupted by worker shutdown")}
    assert r.keep() == []


async def test_abandoned_handlers_end_with_nothing_written(jobs: Jobs) -> None:
    """A worker torn down: the handlers are cancelled, their rows left to the reaper."""
    r = jobs.running
    r.dispatch(a_job(1))
    await jobs.started((1, 1))
    task = jobs.get((1, 1)).task
    r.abandon_all()
    assert task is not None
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not r and jobs.outcomes == {(1, 1): None}


async def test_the_heartbeat_thread_reads_while_the_loop_dispatches_and_finishes(
        jobs: Jobs) -> None:
    """leased() and tasks() copy with tuple(), which runs no Python code: the loop cannot
    change the dict mid-copy, however often the two race."""
    jobs.gate.set()
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                jobs.running.leased()
                jobs.running.tasks()
            except BaseException as e:  # any error is the failure
                errors.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(20):
            for i in range(100):
                jobs.running.dispatch(a_job(n * 100 + i))
            await asyncio.wait_for(jobs.running.all_finished(), 5)
    finally:
        done.set()
        reader.join(5)
    assert errors == []
    assert len(jobs.outcomes) == 2000
