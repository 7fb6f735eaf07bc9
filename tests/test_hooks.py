"""Hooks and middleware (hooks.py): every event, with its arguments; failures never reach a job."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest
from conftest import execute, running, wait_for

from asyncjobq import ConfigurationError, Fail, Job, Queue, Retry, Worker
from asyncjobq._maintenance import reaper as reaper_module
from asyncjobq._maintenance.reaper import Reaper


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def of(self, event: str) -> list[dict[str, Any]]:
        return [kw for e, kw in self.events if e == event]

    async def on_enqueued(self, **kw: Any) -> None:
        self.events.append(("on_enqueued", kw))

    async def on_claimed(self, **kw: Any) -> None:
        self.events.append(("on_claimed", kw))

    async def on_started(self, **kw: Any) -> None:
        self.events.append(("on_started", kw))

    async def on_finished(self, **kw: Any) -> None:
        self.events.append(("on_finished", kw))

    async def on_reaped(self, **kw: Any) -> None:
        self.events.append(("on_reaped", kw))

    async def on_leader_changed(self, **kw: Any) -> None:
        self.events.append(("on_leader_changed", kw))


async def test_every_job_event_fires_with_its_arguments(queue: Queue) -> None:
    rec = Recorder()
    queue.add_hook(rec)
    release = asyncio.Event()

    @queue.task(name="outcomes", max_attempts=2, backoff=lambda a: 0)
    async def outcomes(job: Job) -> None:
        kind = job.payload["kind"]
        if kind == "retry" and job.attempt == 1:
            raise RuntimeError("first attempt fails")
        if kind == "snooze" and job.attempt == 1:
            raise Retry(delay=0)
        if kind == "fail":
            raise Fail("no")
        if kind == "hang":
            await release.wait()

    ids = {k: await outcomes.enqueue({"kind": k}) for k in ("done", "retry", "snooze", "fail")}
    w = Worker(queue, poll_interval=0.1, shutdown_timeout=0.2)
    async with running(w):
        await wait_for(lambda: len(rec.of("on_finished")) == 6, timeout=15,
                       what="six attempts finished")
        hang = await outcomes.enqueue({"kind": "hang"})
        await wait_for(lambda: any(kw["job"].id == hang for kw in rec.of("on_started")),
                       timeout=10, what="the hanging job started")
    await wait_for(lambda: len(rec.of("on_finished")) == 7, timeout=10, what="hang finished")
    ids["hang"] = hang

    enqueued = rec.of("on_enqueued")
    assert [kw["job_ids"] for kw in enqueued] == [[i] for i in ids.values()]
    assert all(kw["task"] == "outcomes" and kw["queue"] == "default" for kw in enqueued)
    claimed = [j.id for kw in rec.of("on_claimed") for j in kw["jobs"]]
    assert sorted(claimed) == sorted([*ids.values(), ids["retry"], ids["snooze"]])
    started = [(kw["job"].id, kw["job"].attempt) for kw in rec.of("on_started")]
    finished = {(kw["job"].id, kw["job"].attempt): kw for kw in rec.of("on_finished")}
    assert sorted(started) == sorted(finished)
    expect = {(ids["done"], 1): "done", (ids["retry"], 1): "retry", (ids["retry"], 2): "done",
              (ids["snooze"], 1): "snoozed", (ids["snooze"], 2): "done",
              (ids["fail"], 1): "failed", (ids["hang"], 1): "cancelled"}
    assert {k: kw["outcome"] for k, kw in finished.items()} == expect
    assert all(isinstance(kw["duration"], float) and kw["duration"] >= 0
               for kw in finished.values())
    assert finished[ids["hang"], 1]["duration"] >= 0.2


async def test_reaped_and_leader_changed_fire(queue: Queue) -> None:
    rec = Recorder()
    queue.add_hook(rec)
    job_id = await queue.enqueue("nobody", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', locked_by = 'dead',"
                  " locked_at = now() - interval '1 hour', attempts = 1 WHERE id = %s", job_id)
    w = Worker(queue, queues=["elsewhere"], lease=3.0, poll_interval=0.1, reap_interval=0.1)
    async with running(w):
        await wait_for(lambda: bool(rec.of("on_reaped")), timeout=10, what="on_reaped")
        assert rec.of("on_leader_changed")[0] == {"worker_id": w.id}
    assert rec.of("on_reaped") == [{"job_ids": [job_id]}]


async def test_a_raising_or_slow_hook_never_affects_a_job(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")

    class Broken:
        async def on_started(self, job: Job) -> None:
            raise RuntimeError("hook bug")

        async def on_finished(self, **kw: Any) -> None:
            raise ValueError("another hook bug")

        async def on_claimed(self, **kw: Any) -> None:
            await asyncio.sleep(3600)  # never returns

    queue.add_hook(Broken())
    rec = Recorder()
    queue.add_hook(rec)  # hooks after a broken one still run

    @queue.task(name="fine")
    async def fine(job: Job) -> None:
        pass

    ids = await queue.enqueue_many("fine", [{} for _ in range(20)])
    w = Worker(queue, poll_interval=0.1, shutdown_timeout=1)
    async with running(w):
        await wait_for(lambda: w.completed == 20, timeout=15, what="20 jobs done")
    for i in ids:
        info = await queue.get(i)
        assert info is not None and info.status == "done" and info.attempts == 1
    assert len(rec.of("on_finished")) == 20
    assert "Broken.on_started raised RuntimeError: hook bug" in caplog.text
    assert "Broken.on_finished raised ValueError" in caplog.text
    assert caplog.text.count("Broken.on_finished raised") == 1  # then at debug level


async def test_middleware_wraps_outermost_first_and_may_swallow_or_replace(
        queue: Queue) -> None:
    order: list[str] = []
    results: list[object] = []

    def tracer(name: str) -> Any:
        async def mw(job: Job, call_next: Any) -> object:
            order.append(f"{name} in")
            try:
                return await call_next(job)
            finally:
                order.append(f"{name} out")
        return mw

    async def swallow(job: Job, call_next: Any) -> object:
        try:
            result = await call_next(job)
        except RuntimeError:
            return "swallowed"
        results.append(result)
        return "replaced"

    queue.add_middleware(tracer("outer"))
    queue.add_middleware(tracer("inner"))
    queue.add_middleware(swallow)

    @queue.task(name="mw", max_attempts=1)
    async def mw_task(job: Job) -> str:
        order.append("handler")
        if job.payload.get("boom"):
            raise RuntimeError("boom")
        return "original"

    ok = await mw_task.enqueue({})
    boom = await mw_task.enqueue({"boom": True})
    async with running(Worker(queue, concurrency=1, poll_interval=0.1)):
        await wait_for(lambda: order.count("outer out") == 2, timeout=10)
    assert order[:5] == ["outer in", "inner in", "handler", "inner out", "outer out"]
    assert results == ["original"]
    for i in (ok, boom):  # the swallowed failure counts as done
        info = await queue.get(i)
        assert info is not None and info.status == "done", info


async def test_middleware_may_fail_or_retry_a_job(queue: Queue) -> None:
    async def gate(job: Job, call_next: Any) -> object:
        if job.payload.get("deny"):
            raise Fail("denied by middleware")
        return await call_next(job)

    queue.add_middleware(gate)

    @queue.task(name="gated")
    async def gated(job: Job) -> None:
        pass

    denied = await gated.enqueue({"deny": True})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: _status(queue, denied, "failed"), timeout=10)
    info = await queue.get(denied)
    assert info is not None and info.last_error is not None
    assert "denied by middleware" in info.last_error


async def _status(queue: Queue, job_id: int, status: str) -> bool:
    info = await queue.get(job_id)
    return info is not None and info.status == status


async def test_bad_hooks_and_middleware_are_refused(queue: Queue) -> None:
    class Nothing:
        pass

    class SyncHook:
        def on_started(self, job: Job) -> None:
            pass

    def sync_mw(job: Job, call_next: Any) -> object:
        return None

    with pytest.raises(ConfigurationError, match="none of the hook methods"):
        queue.add_hook(Nothing())
    with pytest.raises(ConfigurationError, match=r"SyncHook\.on_started .*async def"):
        queue.add_hook(SyncHook())
    with pytest.raises(ConfigurationError, match="not a coroutine function"):
        queue.add_middleware(sync_mw)
    assert not queue.hooks.active


async def test_a_hanging_hook_holds_up_neither_maintenance_nor_enqueue(queue: Queue) -> None:
    """Hooks run in tasks of their own: an on_reaped or on_leader_changed that never returns
    must not stall the leader's reaper or elector, nor an on_enqueued the enqueue."""
    forever = asyncio.Event()

    class Hanging:
        async def on_reaped(self, **kw: Any) -> None:
            await forever.wait()

        async def on_leader_changed(self, **kw: Any) -> None:
            await forever.wait()

        async def on_enqueued(self, **kw: Any) -> None:
            await forever.wait()

    queue.add_hook(Hanging())
    queue.hooks.timeout = 3600  # the hooks' own bound is not what is tested here
    stale = "UPDATE {s}.jobs SET status = 'running', locked_by = 'dead'," \
            " locked_at = now() - interval '1 hour', attempts = 1 WHERE id = %s"
    first = await asyncio.wait_for(queue.enqueue("nobody", {}), timeout=5)
    await execute(queue, stale, first)
    w = Worker(queue, queues=["elsewhere"], lease=3.0, poll_interval=0.1, reap_interval=0.1,
               shutdown_timeout=0.5)
    async with running(w):
        await wait_for(lambda: _status(queue, first, "queued"), timeout=10, what="first reaped")
        second = await asyncio.wait_for(queue.enqueue("nobody", {}), timeout=5)
        await execute(queue, stale, second)
        await wait_for(lambda: _status(queue, second, "queued"), timeout=10,
                       what="second reaped while the first on_reaped still hangs")
        assert w.elector is not None
        renewals = w.elector.terms
        assert w.elector.is_leader and renewals == 1
    forever.set()


async def _status(queue: Queue, job_id: int, status: str) -> bool:
    info = await queue.get(job_id)
    return info is not None and info.status == status


async def test_hooks_raising_base_exceptions_or_outlasting_their_timeout_are_contained(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    """SystemExit, KeyboardInterrupt or a CancelledError of the hook's own, raised in a hook,
    would end the event loop (or the hook's caller); a hook past Hooks.timeout is cancelled."""
    caplog.set_level(logging.WARNING, logger="asyncjobq")

    class Hostile:
        async def on_claimed(self, **kw: Any) -> None:
            raise SystemExit(3)

        async def on_finished(self, **kw: Any) -> None:
            raise KeyboardInterrupt

        async def on_started(self, **kw: Any) -> None:
            raise asyncio.CancelledError

    class Slow:
        async def on_finished(self, **kw: Any) -> None:
            await asyncio.sleep(3600)

    queue.add_hook(Hostile())
    queue.add_hook(Slow())
    queue.hooks.timeout = 0.2

    @queue.task(name="fine")
    async def fine(job: Job) -> None:
        pass

    ids = await queue.enqueue_many("fine", [{} for _ in range(10)])
    w = Worker(queue, poll_interval=0.1, shutdown_timeout=1)
    async with running(w):
        await wait_for(lambda: w.completed == 10, timeout=15, what="10 jobs done")
        await wait_for(lambda: "took more than 0.2 s and was cancelled" in caplog.text,
                       timeout=10, what="the slow hook cancelled")
    for i in ids:
        info = await queue.get(i)
        assert info is not None and info.status == "done" and info.attempts == 1
    assert "Hostile.on_claimed raised SystemExit" in caplog.text
    assert "Hostile.on_finished raised KeyboardInterrupt" in caplog.text
    assert "Hostile.on_started raised CancelledError" in caplog.text


async def test_on_started_is_outside_the_handlers_timeout_and_after_on_claimed(
        queue: Queue) -> None:
    order: list[str] = []

    class Slow:
        async def on_claimed(self, **kw: Any) -> None:
            order.append("claimed")

        async def on_started(self, **kw: Any) -> None:
            order.append("started")
            await asyncio.sleep(0.5)  # longer than the handler's timeout

    queue.add_hook(Slow())

    @queue.task(name="quick", timeout=0.3, max_attempts=1)
    async def quick(job: Job) -> None:
        pass

    job_id = await quick.enqueue({})
    w = Worker(queue, poll_interval=0.1)
    async with running(w):
        await wait_for(lambda: _finished(queue, job_id), timeout=10, what="job finished")
    info = await queue.get(job_id)
    assert info is not None and info.status == "done", info
    assert order == ["claimed", "started"]


async def _finished(queue: Queue, job_id: int) -> bool:
    info = await queue.get(job_id)
    return info is not None and info.status in ("done", "failed")


async def test_on_reaped_hears_of_each_batch_even_when_a_later_one_fails(
        queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaped in batches, each committed on its own: a later batch that fails must not keep
    on_reaped from hearing of the jobs already requeued."""
    monkeypatch.setattr(reaper_module, "REAP_BATCH", 2)
    rec = Recorder()
    queue.add_hook(rec)
    ids = await queue.enqueue_many("t", [{} for _ in range(3)])
    # The third (latest locked) job is reaped in the second batch, which a trigger refuses.
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1,"
                  " locked_by = 'gone', locked_at = now() - interval '1 hour' + id * interval"
                  " '1 s'")
    await execute(queue, "CREATE FUNCTION {s}.refuse() RETURNS trigger LANGUAGE plpgsql AS"
                  " $$BEGIN RAISE EXCEPTION 'refused'; END$$")
    await execute(queue, "CREATE TRIGGER refuse BEFORE UPDATE ON {s}.jobs FOR EACH ROW"
                  f" WHEN (OLD.id = {ids[2]}) EXECUTE FUNCTION {{s}}.refuse()")
    reaper = Reaper(queue.database, lease=30, interval=1, hooks=queue.hooks)
    with pytest.raises(psycopg.errors.RaiseException):
        await reaper.reap()
    await wait_for(lambda: bool(rec.of("on_reaped")), timeout=10, what="on_reaped")
    assert rec.of("on_reaped") == [{"job_ids": ids[:2]}]


async def test_observers_are_plain_methods_called_inline_and_their_errors_logged(
        queue: Queue, caplog: pytest.LogCaptureFixture) -> None:
    class Wrong:
        async def on_finished(self, **kw: Any) -> None:
            pass

    with pytest.raises(ConfigurationError, match="plain `def`"):
        queue.hooks.add_observer(Wrong())
    with pytest.raises(ConfigurationError, match="none of the hook methods"):
        queue.hooks.add_observer(object())

    seen: list[str] = []

    class Counting:
        def on_started(self, job: Job) -> None:
            seen.append("started")

        def on_finished(self, job: Job, outcome: str, duration: float) -> None:
            seen.append(outcome)
            raise RuntimeError("observer bug")

    counting = Counting()
    queue.hooks.add_observer(counting)
    queue.hooks.add_observer(counting)  # registered once, not counted twice

    @queue.task(name="t")
    async def t(job: Job) -> None:
        pass

    job_id = await queue.enqueue("t", {})
    async with running(Worker(queue, poll_interval=0.1)):
        await wait_for(lambda: seen == ["started", "done"], timeout=10, what="both observed")
    info = await queue.get(job_id)
    assert info is not None and info.status == "done"
    assert "observer bug" in caplog.text
