"""asyncjobq.testing: isolated, drain, perform, assert_enqueued, refute_enqueued,
enqueued, and the pytest plugin's asyncjobq_isolated fixture."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from conftest import ROOT
from psycopg import sql

from asyncjobq import AsyncJobQError, ConfigurationError, Fail, Job, Queue, Retry, Task
from asyncjobq.testing import (
    Outcome,
    assert_enqueued,
    drain,
    enqueued,
    isolated,
    perform,
    refute_enqueued,
)


@dataclass
class App:
    """An app as users write one: a module-level Queue with its tasks."""

    queue: Queue
    welcome: Task
    flaky: Task
    doomed: Task
    snooze: Task
    slow: Task
    total: Task
    ran: list[tuple[str, dict[str, Any], int]] = field(default_factory=list)


def make_app() -> App:
    queue = Queue(schema="app_never_used")
    ran: list[tuple[str, dict[str, Any], int]] = []

    @queue.task(name="welcome", queue="emails")
    async def welcome(job: Job) -> str:
        ran.append(("welcome", job.payload, job.attempt))
        return f"sent to {job.payload['to']}"

    @queue.task(name="flaky", max_attempts=3)
    async def flaky(job: Job) -> None:
        ran.append(("flaky", job.payload, job.attempt))
        if job.attempt < job.payload.get("succeed_at", 99):
            raise RuntimeError(f"boom {job.attempt}")

    @queue.task(name="doomed")
    async def doomed(job: Job) -> None:
        raise Fail("card declined")

    @queue.task(name="snooze")
    async def snooze(job: Job) -> None:
        ran.append(("snooze", job.payload, job.attempt))
        raise Retry(delay=job.payload.get("delay", 60))

    @queue.task(name="slow", timeout=0.05)
    async def slow(job: Job) -> None:
        await asyncio.sleep(10)

    @queue.task(name="total")
    def total(job: Job) -> int:  # a plain def: runs in a worker thread
        return int(sum(job.payload["items"]))

    return App(queue, welcome, flaky, doomed, snooze, slow, total, ran)


@pytest_asyncio.fixture(loop_scope="function")
async def app(pg_dsn: str) -> AsyncIterator[App]:
    a = make_app()
    async with isolated(a.queue, dsn=pg_dsn):
        yield a


async def schema_exists(dsn: str, name: str) -> bool:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (name,))
        return await cur.fetchone() is not None


# --- isolated ------------------------------------------------------------------------------

async def test_isolated_binds_the_apps_own_queue_to_a_fresh_schema_and_restores_it(
        pg_dsn: str) -> None:
    a = make_app()
    assert a.queue.schema == "app_never_used"
    schemas = []
    for _ in range(2):
        async with isolated(a.queue, dsn=pg_dsn) as q:
            assert q is a.queue
            assert q.schema.startswith("asyncjobq_test_") and q.database.is_open
            schemas.append(q.schema)
            assert await schema_exists(pg_dsn, q.schema)
            # The module-level Task enqueues through the same object, so into the schema.
            job_id = await a.welcome.enqueue({"to": "a@example.com"})
            info = await q.get(job_id)
            assert info is not None and info.status == "queued"
            # The app's own tables made through the queue's connections land in the schema.
            async with q.connection() as conn:
                await conn.execute("CREATE TABLE users (id int)")
                cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                         (f"{q.schema}.users",))
                assert await cur.fetchone() == (True,)
        assert not await schema_exists(pg_dsn, schemas[-1])
        assert a.queue.schema == "app_never_used" and not a.queue.database.is_open
        assert a.queue.database.where() == "unresolved"  # its DSN as it was: never resolved
    assert schemas[0] != schemas[1]


async def test_isolated_drops_the_schema_when_the_test_fails(pg_dsn: str) -> None:
    a = make_app()
    with pytest.raises(ZeroDivisionError):
        async with isolated(a.queue, dsn=pg_dsn) as q:
            name = q.schema
            raise ZeroDivisionError
    assert not await schema_exists(pg_dsn, name)
    assert a.queue.schema == "app_never_used"


async def test_isolated_takes_the_test_dsn_from_the_environment(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCJOBQ_TEST_DSN", pg_dsn)
    a = make_app()
    async with isolated(a.queue) as q:
        assert await q.stats() == {}


async def test_isolated_refuses_an_open_queue_and_what_is_not_a_queue(pg_dsn: str) -> None:
    a = make_app()
    async with isolated(a.queue, dsn=pg_dsn) as q:
        with pytest.raises(ConfigurationError, match=r"closed, but it is open: enter "
                                                     r"isolated\(\) before the app opens it"):
            async with isolated(q, dsn=pg_dsn):
                pass
    with pytest.raises(ConfigurationError, match=r"takes the app's asyncjobq.Queue, got a str"):
        async with isolated("queue", dsn=pg_dsn):  # type: ignore[arg-type]
            pass
    for bad in ("postgresql://host:notaport/db", "host='unclosed"):
        with pytest.raises(ConfigurationError, match="malformed"):
            async with isolated(a.queue, dsn=bad):
                pass
    assert a.queue.schema == "app_never_used"


# --- enqueued, assert_enqueued, refute_enqueued --------------------------------------------

async def test_assert_enqueued_matches_a_payload_subset_and_returns_the_job(app: App) -> None:
    q = app.queue
    first = await app.welcome.enqueue({"to": "a@example.com", "lang": "fr"})
    await app.welcome.enqueue({"to": "b@example.com"})
    job = await assert_enqueued(q, app.welcome, {"to": "a@example.com"})
    assert (job.id, job.task, job.queue) == (first, "welcome", "emails")
    assert (await assert_enqueued(q, "welcome", queue="emails")).id == first
    await refute_enqueued(q, app.welcome, {"to": "c@example.com"})
    await refute_enqueued(q, app.flaky)
    assert [j.payload["to"] for j in await enqueued(q, app.welcome)] == [
        "a@example.com", "b@example.com"]
    assert await enqueued(q, "flaky") == []
    assert len(await enqueued(q, queue="emails")) == 2


async def test_assert_enqueued_fails_listing_what_was_enqueued_instead(app: App) -> None:
    q = app.queue
    await app.welcome.enqueue({"to": "b@example.com"})
    await app.flaky.enqueue({"n": 1}, delay=3600)
    with pytest.raises(AssertionError) as e:
        await assert_enqueued(q, app.welcome, {"to": "a@example.com"})
    text = str(e.value)
    assert text.startswith("expected a job of task 'welcome' with payload containing "
                           "{'to': 'a@example.com'} to be enqueued, but the 2 enqueued job(s) "
                           "are:\n")
    assert re.search(r"#\d+ task='welcome' queue='emails' payload=\{'to': 'b@example.com'\}$",
                     text.splitlines()[1])
    assert re.search(r"#\d+ task='flaky' queue='default' payload=\{'n': 1\} run_at=",
                     text.splitlines()[2])
    with pytest.raises(AssertionError, match="in queue 'default'"):
        await assert_enqueued(q, app.welcome, queue="default")
    # A misspelt name is pointed out.
    with pytest.raises(AssertionError, match="no task 'welcom' is registered on this queue"):
        await assert_enqueued(q, "welcom")
    with pytest.raises(AssertionError) as e:
        await refute_enqueued(q, app.welcome)
    assert "expected no a job" not in str(e.value)
    assert str(e.value).startswith("expected no job of task 'welcome' to be enqueued, but found "
                                   "1:\n  #")


async def test_an_empty_queue_says_so(app: App) -> None:
    with pytest.raises(AssertionError, match=r"but no job is enqueued$"):
        await assert_enqueued(app.queue, app.welcome)


async def test_with_conn_the_callers_uncommitted_transaction_is_seen(app: App) -> None:
    q = app.queue
    async with q.connection() as conn:
        async with conn.transaction(force_rollback=True):
            await app.welcome.enqueue({"to": "tx@example.com"}, conn=conn)
            await assert_enqueued(q, app.welcome, {"to": "tx@example.com"}, conn=conn)
            # Not committed: nobody else sees it.
            await refute_enqueued(q, app.welcome)
            with pytest.raises(AssertionError, match=r"to be enqueued, but no job"):
                await assert_enqueued(q, app.welcome)
            with pytest.raises(AssertionError, match="as seen by the given connection"):
                await refute_enqueued(q, app.welcome, conn=conn)
        # Rolled back: gone for everyone.
        await refute_enqueued(q, app.welcome, conn=conn)
    await refute_enqueued(q, app.welcome)


async def test_assertion_helpers_name_the_fix_for_a_bad_argument(app: App, pg_dsn: str) -> None:
    q = app.queue
    with pytest.raises(ConfigurationError, match=r"task=42: pass the Task object"):
        await assert_enqueued(q, 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"payload='to': pass a dict of the keys"):
        await assert_enqueued(q, app.welcome, "to")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"takes the asyncjobq.Queue first, got a Task"):
        await enqueued(app.welcome)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"conn= takes a psycopg.AsyncConnection, got "
                                                 "a Connection"):
        with psycopg.connect(pg_dsn) as sync_conn:
            await refute_enqueued(q, app.welcome, conn=sync_conn)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="queue=3: pass a queue name"):
        await assert_enqueued(q, app.welcome, queue=3)  # type: ignore[arg-type]


# --- drain ---------------------------------------------------------------------------------

async def test_drain_runs_due_jobs_through_the_executor_and_counts_the_outcomes(
        app: App) -> None:
    q = app.queue
    ok = await app.welcome.enqueue({"to": "a@example.com"})
    doomed = await app.doomed.enqueue({})
    slow = await app.slow.enqueue({}, max_attempts=1)
    flaky = await app.flaky.enqueue({})
    snoozed = await app.snooze.enqueue({})
    summed = await app.total.enqueue({"items": [1, 2]})
    assert await drain(q) == {"done": 2, "retry": 1, "failed": 2, "snoozed": 1}
    states = {i: (await q.get(i)) for i in (ok, doomed, slow, flaky, snoozed, summed)}
    assert {i: s.status for i, s in states.items() if s} == {
        ok: "done", doomed: "failed", slow: "failed", flaky: "queued", snoozed: "queued",
        summed: "done"}
    assert states[doomed] and states[doomed].last_error == "attempt 1: Fail: card declined"
    assert states[slow] and states[slow].last_error == "attempt 1: timed out after 0.05 s"
    assert states[flaky] and states[flaky].last_error == "attempt 1: RuntimeError: boom 1"
    # The retry and the snooze are not due yet (backoff, Retry(delay=60)): nothing more runs.
    assert await drain(q) == {"done": 0, "retry": 0, "failed": 0, "snoozed": 0}


async def test_drain_leaves_future_jobs_unless_until_reaches_them(app: App) -> None:
    q = app.queue
    now = datetime.now(UTC)
    soon = await app.welcome.enqueue({"to": "soon"}, run_at=now + timedelta(minutes=5))
    later = await app.welcome.enqueue({"to": "later"}, run_at=now + timedelta(hours=2))
    assert await drain(q) == {"done": 0, "retry": 0, "failed": 0, "snoozed": 0}
    assert await drain(q, until=timedelta(minutes=10)) == {
        "done": 1, "retry": 0, "failed": 0, "snoozed": 0}
    assert [(await q.get(i)).status for i in (soon, later)] == ["done", "queued"]  # type: ignore[union-attr]
    assert await drain(q, until=now + timedelta(days=1)) == {
        "done": 1, "retry": 0, "failed": 0, "snoozed": 0}


async def test_drain_until_runs_retries_after_their_backoff_to_the_end(app: App) -> None:
    q = app.queue
    failing = await app.flaky.enqueue({})
    third_time = await app.flaky.enqueue({"succeed_at": 3})
    assert await drain(q, until=timedelta(hours=1)) == {
        "done": 1, "retry": 4, "failed": 1, "snoozed": 0}
    info = await q.get(failing)
    assert info is not None and (info.status, info.attempts) == ("failed", 3)
    info = await q.get(third_time)
    assert info is not None and (info.status, info.attempts) == ("done", 3)
    # Each attempt once, each after the job's previous one.
    assert [n for _, p, n in app.ran if "succeed_at" in p] == [1, 2, 3]
    assert [n for _, p, n in app.ran if "succeed_at" not in p] == [1, 2, 3]


async def test_drain_runs_middleware_and_hooks(app: App) -> None:
    q = app.queue
    events: list[str] = []

    async def mw(job: Job, call_next: Callable[[Job], Any]) -> object:
        events.append(f"mw {job.task}")
        return await call_next(job)

    class Hook:
        async def on_claimed(self, jobs: list[Job]) -> None:
            events.append(f"claimed {[j.task for j in jobs]}")

        async def on_started(self, job: Job) -> None:
            events.append(f"started {job.task}")

        async def on_finished(self, job: Job, outcome: str, duration: float) -> None:
            events.append(f"finished {job.task} {outcome}")

    q.add_middleware(mw)
    q.add_hook(Hook())
    await app.welcome.enqueue({"to": "x"})
    await drain(q)
    assert events == ["claimed ['welcome']", "started welcome", "mw welcome",
                      "finished welcome done"]


async def test_drain_filters_by_queue_and_stops_at_max_jobs(app: App) -> None:
    q = app.queue
    await app.welcome.enqueue({"to": "1"})
    await app.welcome.enqueue({"to": "2"})
    await app.total.enqueue({"items": [1]}, priority=5)
    assert await drain(q, queues="emails", max_jobs=1) == {
        "done": 1, "retry": 0, "failed": 0, "snoozed": 0}
    assert [p["to"] for _, p, _ in app.ran] == ["1"]
    await assert_enqueued(q, app.total)  # another queue: left alone
    assert (await drain(q, queues=["default"]))["done"] == 1
    assert (await drain(q))["done"] == 1


async def test_drain_stops_a_job_that_retries_at_once_forever(app: App) -> None:
    q = app.queue
    job_id = await app.snooze.enqueue({"delay": 0})
    with pytest.raises(AsyncJobQError, match=r"ran 100 times in this drain and is due again "
                                             r"at once .* give the Retry a delay, or pass "
                                             r"max_jobs="):
        await drain(q)
    assert len(app.ran) == 100
    info = await q.get(job_id)
    assert info is not None and info.status == "queued"  # put back, not left running


async def test_drain_names_the_fix_for_a_bad_argument(app: App) -> None:
    q = app.queue
    with pytest.raises(ConfigurationError, match="has no timezone"):
        await drain(q, until=datetime.now())
    with pytest.raises(ConfigurationError, match=r"until='1h': pass a datetime"):
        await drain(q, until="1h")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"max_jobs=0: use a number"):
        await drain(q, max_jobs=0)
    with pytest.raises(ConfigurationError, match=r"queues=\[\]: pass a queue name"):
        await drain(q, queues=[])
    with pytest.raises(ConfigurationError, match=r"takes the asyncjobq.Queue first"):
        await drain(None)  # type: ignore[arg-type]


# --- perform -------------------------------------------------------------------------------

async def test_perform_returns_the_value_or_how_the_attempt_ended() -> None:
    # Without a database: the queue is never opened.
    a = make_app()
    q = a.queue
    assert await perform(q, a.welcome, {"to": "a@example.com"}) == "sent to a@example.com"
    assert await perform(q, "total", {"items": [2, 3]}) == 5  # a plain def, in a thread
    retry = await perform(q, a.flaky)
    assert isinstance(retry, Outcome) and retry.kind == "retry"
    assert retry.error == "attempt 1: RuntimeError: boom 1" and retry.delay >= 2
    assert await perform(q, a.flaky, attempt=3) == Outcome(
        "failed", "attempt 3: RuntimeError: boom 3")
    assert await perform(q, a.doomed) == Outcome("failed", "attempt 1: Fail: card declined")
    assert await perform(q, a.snooze, {"delay": 5}) == Outcome("snoozed", None, 5.0)
    slow = await perform(q, a.slow)
    assert isinstance(slow, Outcome) and slow.error == "attempt 1: timed out after 0.05 s"
    assert not q.database.is_open


async def test_perform_runs_the_middleware_and_returns_what_it_passed_back() -> None:
    a = make_app()
    finished: list[str] = []

    async def shout(job: Job, call_next: Callable[[Job], Any]) -> object:
        return str(await call_next(job)).upper()

    class Hook:
        async def on_finished(self, job: Job, outcome: str, duration: float) -> None:
            finished.append(outcome)

    a.queue.add_middleware(shout)
    a.queue.add_hook(Hook())
    assert await perform(a.queue, a.welcome, {"to": "b"}) == "SENT TO B"
    assert finished == ["done"]


async def test_perform_names_the_fix_for_a_bad_argument() -> None:
    a = make_app()
    with pytest.raises(ConfigurationError, match=r"task 'nope' is not registered on this queue "
                                                 r"\(registered: doomed, flaky, slow, snooze, "
                                                 r"total, welcome\)"):
        await perform(a.queue, "nope")
    with pytest.raises(ConfigurationError, match="attempt=0: use 1"):
        await perform(a.queue, a.welcome, {"to": "x"}, attempt=0)
    with pytest.raises(ConfigurationError, match=r"payload=\['x'\]: pass a dict"):
        await perform(a.queue, a.welcome, ["x"])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"takes the app's asyncjobq.Queue first"):
        await perform(a.welcome, a.welcome)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"payload is not JSON-serialisable .* pass "
                                                 r"only dicts"):
        await perform(a.queue, a.welcome, {"to": object()})


# --- the plugin ----------------------------------------------------------------------------

async def test_the_plugin_fixture_isolates_a_queue_on_the_sessions_server(
        asyncjobq_isolated: Callable[[Queue], AbstractAsyncContextManager[Queue]],
        pg_dsn: str) -> None:
    a = make_app()
    async with asyncjobq_isolated(a.queue) as q:
        assert q is a.queue and q.schema.startswith("asyncjobq_test_")
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            cur = await conn.execute(sql.SQL("SELECT count(*) FROM {}.jobs").format(
                sql.Identifier(q.schema)))
            assert await cur.fetchone() == (0,)


# --- the example, run as a user runs it ----------------------------------------------------

EXAMPLE_FILES = ("starlette_app.py", "conftest.py", "test_starlette_app.py")


def run_pytest(where: Path, dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ASYNCJOBQ_DSN", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env["ASYNCJOBQ_TEST_DSN"] = dsn
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.processes
def test_the_example_suite_passes_in_a_clean_directory_through_the_entry_point(
        tmp_path: Path, pg_dsn: str) -> None:
    """examples/'s tests as a separate pytest session away from this repository (no
    pyproject, no conftest of ours): the fixture can only come from the installed package's
    pytest11 entry point."""
    for name in EXAMPLE_FILES:
        shutil.copy(ROOT / "examples" / name, tmp_path / name)
    assert "pytest_plugins" not in (tmp_path / "conftest.py").read_text()
    result = run_pytest(tmp_path, pg_dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b2 passed\b", result.stdout), result.stdout
    # Without the plugin the fixture is missing: it was the entry point that provided it.
    result = run_pytest(tmp_path, pg_dsn, "-p", "no:asyncjobq")
    assert result.returncode != 0
    assert "fixture 'asyncjobq_isolated' not found" in result.stdout, result.stdout


@pytest.mark.processes
def test_the_helpers_import_without_pytest_and_the_plugin_finds_its_own_server(
        tmp_path: Path) -> None:
    """`pip install asyncjobq` users have no pytest: asyncjobq.testing must not need it. And
    with no $ASYNCJOBQ_TEST_DSN the plugin starts an embedded PostgreSQL of the session's."""
    check = subprocess.run(
        [sys.executable, "-c", "import sys, asyncjobq.testing; "
         "sys.exit('pytest imported' if 'pytest' in sys.modules else 0)"],
        capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    (tmp_path / "test_alone.py").write_text(
        "import pytest\n"
        "from asyncjobq import Queue\n"
        "from asyncjobq.testing import drain\n\n"
        "app = Queue(schema='alone')\n\n"
        "@app.task(name='noop')\n"
        "async def noop(job):\n    return None\n\n"
        "@pytest.mark.asyncio\n"
        "async def test_alone(asyncjobq_isolated):\n"
        "    async with asyncjobq_isolated(app) as q:\n"
        "        await noop.enqueue()\n"
        "        assert (await drain(q))['done'] == 1\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ASYNCJOBQ_DSN", "ASYNCJOBQ_TEST_DSN", "ASYNCJOBQ_HOME")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--basetemp", str(tmp_path / "base")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b1 passed\b", result.stdout), result.stdout
    # The server lived in the session's temporary directory (deleted after it), not in
    # ./.asyncjobq.
    assert (tmp_path / "base" / "asyncjobq-pg0").is_dir()
    assert not (tmp_path / "base" / "asyncjobq-pg0" / "data").exists()
    assert not (tmp_path / ".asyncjobq").exists()


# --- what a hostile review found (helper-16) -------------------------------------------------

async def test_an_app_lifespan_closing_the_queue_inside_the_block_leaves_it_open(
        pg_dsn: str) -> None:
    a = make_app()
    async with isolated(a.queue, dsn=pg_dsn) as q:
        async with q:  # the app's lifespan: open (already open), then close at its end
            await a.welcome.enqueue({"to": "x@example.com"})
        assert q.database.is_open
        await assert_enqueued(q, a.welcome, {"to": "x@example.com"})
    assert not a.queue.database.is_open


@pytest.mark.parametrize(("stored", "wanted", "matches"), [
    ({"notify": True, "count": 1.0}, {"notify": 1}, False),
    ({"notify": True, "count": 1.0}, {"count": True}, False),
    ({"flag": 1}, {"flag": True}, False),
    ({"count": 1.0}, {"count": 1}, True),
    ({"ids": [1, 2]}, {"ids": (1, 2)}, True),
    ({"user": {"id": 7, "name": "a"}}, {"user": {"id": 7}}, True),
    ({"user": {"id": 7}}, {"user": {"id": 7, "name": "a"}}, False),
    ({"ids": [1, 2, 3]}, {"ids": [1, 2]}, False),
    ({"n": None}, {"n": None}, True),
    ({"n": 0}, {"n": None}, False),
])
async def test_payloads_match_as_json_values(app: App, stored: dict[str, Any],
                                             wanted: dict[str, Any], matches: bool) -> None:
    await app.queue.enqueue("welcome", stored)
    if matches:
        await assert_enqueued(app.queue, "welcome", wanted)
        with pytest.raises(AssertionError):
            await refute_enqueued(app.queue, "welcome", wanted)
    else:
        await refute_enqueued(app.queue, "welcome", wanted)
        with pytest.raises(AssertionError):
            await assert_enqueued(app.queue, "welcome", wanted)


async def test_perform_hands_the_handler_decoded_json_not_the_callers_objects() -> None:
    queue = Queue(schema="app_never_used")
    seen: list[dict[str, Any]] = []

    @queue.task(name="mutate")
    async def mutate(job: Job) -> None:
        seen.append(job.payload)
        job.payload["items"].append("x")

    items: list[str] = []
    await perform(queue, mutate, {"items": items, "pair": (1, 2)})
    assert items == [], "the handler changed the caller's list"
    assert seen[0]["pair"] == [1, 2]
    from asyncjobq import InvalidPayloadError
    with pytest.raises(InvalidPayloadError, match="cannot store"):
        await perform(queue, mutate, {"items": ["nul \x00 here"]})


async def test_what_a_test_registers_on_the_queue_is_gone_after_its_block(pg_dsn: str) -> None:
    a = make_app()
    before = (dict(a.queue.tasks), a.queue.hooks.middleware)

    async def breaks(job: Job, call_next: Any) -> object:
        raise RuntimeError("test one's middleware")

    async with isolated(a.queue, dsn=pg_dsn) as q:
        q.add_middleware(breaks)

        @q.task(name="only_in_test_one")
        async def only(job: Job) -> None:
            pass

    assert (dict(a.queue.tasks), a.queue.hooks.middleware) == before
    async with isolated(a.queue, dsn=pg_dsn) as q:
        assert await perform(q, a.welcome, {"to": "b@example.com"}) == "sent to b@example.com"


@asynccontextmanager
async def _apps_own_schema(pg_dsn: str, name: str) -> AsyncIterator[str]:
    """A schema of the app's own holding its `orders` table; yields a DSN whose search_path
    is that schema, as an app's DSN (or role setting) would have it."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as c:
        await c.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(name)))
        await c.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {}.orders (id int)")
                        .format(sql.Identifier(name)))
    try:
        quoted = sql.Identifier(name).as_string(None).replace(" ", "\\ ")
        yield psycopg.conninfo.make_conninfo(pg_dsn, options=f"-c search_path={quoted}")
    finally:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as c:
            await c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


async def test_the_test_schema_goes_before_the_dsns_own_search_path(pg_dsn: str) -> None:
    async with _apps_own_schema(pg_dsn, f"app_{os.getpid()}") as dsn:
        a = make_app()
        async with isolated(a.queue, dsn=dsn) as q, q.connection() as conn:
            cur = await conn.execute("SELECT count(*) FROM orders")  # the app's own table
            assert await cur.fetchone() == (0,)
            cur = await conn.execute("SHOW search_path")
            row = await cur.fetchone()
            assert row is not None and row[0].split(",")[0] == q.schema


async def test_a_schema_that_cannot_be_dropped_is_an_error_naming_the_fix(pg_dsn: str) -> None:
    a = make_app()
    holder: psycopg.AsyncConnection[Any] | None = None
    schema = ""
    try:
        with pytest.raises(AsyncJobQError, match="could not drop the test schema") as e:
            async with isolated(a.queue, dsn=pg_dsn) as q:
                schema = q.schema
                holder = await psycopg.AsyncConnection.connect(pg_dsn)
                # Left open by the test: holds a lock on the jobs table past the block.
                await holder.execute(sql.SQL("LOCK TABLE {}.jobs").format(
                    sql.Identifier(schema)))
        assert "DROP SCHEMA" in str(e.value)
    finally:
        if holder is not None:
            await holder.close()
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as c:
            await c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


async def test_drain_until_in_the_past_still_runs_what_is_due(app: App) -> None:
    await app.welcome.enqueue({"to": "now@example.com"})
    counts = await drain(app.queue, until=datetime.now(UTC) - timedelta(days=1))
    assert counts["done"] == 1


async def test_a_timeout_landing_in_the_cleanup_still_restores_the_queue(pg_dsn: str) -> None:
    """A per-test timeout that fires while isolated() closes the queue (here: waiting for a
    slow on_enqueued hook) must not leave the queue open on the test schema, which every
    later isolated() of the session would refuse."""
    a = make_app()

    class SlowHook:
        async def on_enqueued(self, **kw: Any) -> None:
            await asyncio.sleep(3)

    async def test_body() -> None:
        async with isolated(a.queue, dsn=pg_dsn) as q:
            q.add_hook(SlowHook())
            await a.welcome.enqueue({"to": "x@example.com"})
            raise RuntimeError("the test's own failure")

    with pytest.raises((TimeoutError, RuntimeError)):
        await asyncio.wait_for(test_body(), timeout=0.5)
    assert not a.queue.database.is_open
    assert a.queue.schema == "app_never_used" and not a.queue.hooks.on_enqueued
    async with isolated(a.queue, dsn=pg_dsn) as q:  # the next test's block works
        await a.welcome.enqueue({"to": "y@example.com"})
        await assert_enqueued(q, a.welcome, {"to": "y@example.com"})


async def test_a_quoted_schema_with_a_comma_in_the_dsns_search_path_is_kept(
        pg_dsn: str) -> None:
    async with _apps_own_schema(pg_dsn, f"app, {os.getpid()}") as dsn:
        a = make_app()
        async with isolated(a.queue, dsn=dsn) as q, q.connection() as conn:
            cur = await conn.execute("SELECT count(*) FROM orders")  # found in "app, <pid>"
            assert await cur.fetchone() == (0,)
