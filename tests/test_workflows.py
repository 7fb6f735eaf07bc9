"""Workflows: jobs that wait for other jobs, fan-out and fan-in (docs/guides/workflows.md)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest
from conftest import execute, fetchval, run_cli, running, wait_for

from asyncjobq import ConfigurationError, Fail, Job, Queue, Retry, Step, Worker
from asyncjobq.testing import drain


def _worker(q: Queue, **kw: Any) -> Worker:
    kw.setdefault("concurrency", 20)
    return Worker(q, **kw)


async def status_is(q: Queue, job_id: int, status: str) -> bool:
    info = await q.get(job_id)
    return info is not None and info.status == status


async def _statuses(q: Queue, ids: list[int]) -> list[str]:
    out = []
    for i in ids:
        info = await q.get(i)
        assert info is not None, i
        out.append(info.status)
    return out


async def test_a_diamond_runs_each_job_after_its_parents(queue: Queue) -> None:
    order: list[tuple[str, Any]] = []

    @queue.task()
    async def fetch(job: Job) -> dict[str, str]:
        order.append(("fetch", None))
        return {"path": "/tmp/img"}

    @queue.task()
    async def resize(job: Job) -> int:
        await asyncio.sleep(0.05 if job.payload["size"] == 64 else 0)
        order.append(("resize", dict(job.parent_results)))
        return int(job.payload["size"])

    @queue.task()
    async def publish(job: Job) -> list[int]:
        order.append(("publish", dict(job.parent_results)))
        return sorted(job.parent_results.values())

    wf = queue.workflow()
    a = wf.add(fetch, {"url": "u"})
    b = wf.add(resize, {"size": 64}, after=[a])
    c = wf.add(resize, {"size": 256}, after=[a])
    d = wf.add(publish, {}, after=[b, c])
    assert isinstance(d, Step) and len(wf) == 4
    ids = await wf.enqueue()
    assert len(ids) == 4
    assert await _statuses(queue, ids) == ["queued", "waiting", "waiting", "waiting"]
    stats = await queue.stats()
    assert stats["default"]["waiting"] == 3 and stats["default"]["queued"] == 1

    async with running(_worker(queue)):
        assert await queue.result(ids[3], timeout=20) == [64, 256]
    assert [o[0] for o in order] == ["fetch", "resize", "resize", "publish"]
    assert order[1][1] == {ids[0]: {"path": "/tmp/img"}}
    assert order[3][1] == {ids[1]: 64, ids[2]: 256}
    info = await queue.get(ids[3])
    assert info is not None and info.parents == (ids[1], ids[2]) and info.children == ()
    root = await queue.get_detail(ids[0])
    assert root is not None and root.children == (ids[1], ids[2]) and root.parents == ()


async def test_enqueue_after_existing_ids_and_in_the_callers_transaction(
        queue: Queue, pg_dsn: str) -> None:
    @queue.task()
    async def step(job: Job) -> int:
        return int(job.payload["n"])

    first = await step.enqueue({"n": 1})
    second = await queue.enqueue(step, {"n": 2}, after=[first])
    assert (await queue.get(second)).status == "waiting"  # type: ignore[union-attr]
    # In a transaction that rolls back, nothing is left: no job, no edge, and the parent
    # runs its child-less course.
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction(force_rollback=True):
            wf = queue.workflow()
            x = wf.add(step, {"n": 3}, after=[first])
            wf.add(step, {"n": 4}, after=[x, second])
            gone = await wf.enqueue(conn=conn)
    for i in gone:
        assert await queue.get(i) is None
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps") == 1
    async with running(_worker(queue)):
        assert await queue.result(second, timeout=20) == 2
    # A parent that is done already: its child is queued at once.
    third = await step.enqueue({"n": 3}, after=[first, second])
    assert (await queue.get(third)).status == "queued"  # type: ignore[union-attr]


async def test_bad_parents_are_refused_before_anything_is_written(queue: Queue) -> None:
    @queue.task()
    async def step(job: Job) -> None:
        return None

    other = queue.workflow()
    foreign = other.add(step)
    wf = queue.workflow()
    with pytest.raises(ConfigurationError, match="another workflow"):
        wf.add(step, after=[foreign])
    with pytest.raises(ConfigurationError, match="list of the parents"):
        wf.add(step, after=foreign)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_parent_failure"):
        wf.add(step, on_parent_failure="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="after"):
        wf.add(step, after=["7"])  # type: ignore[list-item]
    known = await step.enqueue({})
    with pytest.raises(ConfigurationError, match=r"job 987654321, which does not exist"):
        await queue.enqueue(step, {}, after=[known, 987654321])
    with pytest.raises(ConfigurationError, match="dedup_key"):
        await queue.enqueue(step, {}, after=[known], dedup_key="k")
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 1
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps") == 0
    # A workflow is enqueued once.
    wf.add(step)
    await wf.enqueue()
    with pytest.raises(ConfigurationError, match="enqueued already"):
        await wf.enqueue()
    with pytest.raises(ConfigurationError, match="enqueued already"):
        wf.add(step)


async def test_a_dead_lettered_parent_cancels_its_descendants_or_runs_them(
        queue: Queue) -> None:
    ran: list[str] = []

    @queue.task(max_attempts=1)
    async def breaks(job: Job) -> None:
        raise Fail("broken")

    @queue.task()
    async def step(job: Job) -> str:
        ran.append(job.payload["name"])
        return str(job.payload["name"])

    wf = queue.workflow()
    root = wf.add(breaks)
    child = wf.add(step, {"name": "child"}, after=[root])
    grandchild = wf.add(step, {"name": "grandchild"}, after=[child])
    great = wf.add(step, {"name": "great"}, after=[grandchild])
    anyway = wf.add(step, {"name": "anyway"}, after=[root], on_parent_failure="run")
    after_anyway = wf.add(step, {"name": "after-anyway"}, after=[anyway])
    assert (great.index, after_anyway.index) == (3, 5)
    ids = await wf.enqueue()
    async with running(_worker(queue)):
        await queue.wait(ids[5], timeout=20)
        for i in ids[1:4]:
            await queue.wait(i, timeout=20)
    assert await _statuses(queue, ids) == ["failed", "cancelled", "cancelled", "cancelled",
                                           "done", "done"]
    assert sorted(ran) == ["after-anyway", "anyway"]
    info = await queue.get(ids[2])
    assert info is not None and info.last_error == f"parent {ids[1]} was cancelled"
    info = await queue.get(ids[1])
    assert info is not None and info.last_error == f"parent {ids[0]} was dead-lettered"
    # Counted as every cancel is.
    assert (await queue.stats())["default"]["cancelled"] == 3
    # A child of a parent that failed already is cancelled as it is enqueued (or runs).
    late = await queue.enqueue(step, {"name": "late"}, after=[ids[0]])
    runs = await queue.enqueue(step, {"name": "runs"}, after=[ids[0], ids[4]],
                               on_parent_failure="run")
    assert await _statuses(queue, [late, runs]) == ["cancelled", "queued"]
    # retry_failed reruns the parent alone: its cancelled children stay cancelled.
    assert await queue.retry(ids[0])
    assert (await queue.get(ids[1])).status == "cancelled"  # type: ignore[union-attr]


async def test_a_parents_retries_are_waited_through(queue: Queue) -> None:
    tries: list[int] = []

    @queue.task(max_attempts=3, backoff=lambda attempt: 0.0)
    async def flaky(job: Job) -> str:
        tries.append(job.attempt)
        if job.attempt < 3:
            raise RuntimeError("not yet")
        return "ok"

    @queue.task()
    async def then(job: Job) -> Any:
        return list(job.parent_results.values())

    parent = await flaky.enqueue({})
    child = await then.enqueue({}, after=[parent])
    async with running(_worker(queue)):
        assert await queue.result(child, timeout=20) == ["ok"]
    assert tries == [1, 2, 3]


async def test_cancelling_a_waiting_job_cancels_its_children(queue: Queue) -> None:
    @queue.task()
    async def step(job: Job) -> None:
        return None

    wf = queue.workflow()
    a = wf.add(step, delay=3600)
    b = wf.add(step, after=[a])
    c = wf.add(step, after=[b])
    wf.add(step, after=[b], on_parent_failure="run")
    ids = await wf.enqueue()
    assert c.index == 2
    assert await queue.cancel(ids[1])
    assert await _statuses(queue, ids) == ["queued", "cancelled", "cancelled", "queued"]
    assert not await queue.cancel(ids[1])


async def test_testing_drain_runs_a_workflow_in_order(queue: Queue) -> None:
    seen: list[Any] = []

    @queue.task()
    async def add(job: Job) -> int:
        total = int(job.payload["n"]) + sum(job.parent_results.values())
        seen.append(total)
        return total

    wf = queue.workflow()
    prev = wf.add(add, {"n": 1})
    for n in range(2, 6):
        prev = wf.add(add, {"n": n}, after=[prev])
    await wf.enqueue()
    await drain(queue)
    assert seen == [1, 3, 6, 10, 15]


async def test_a_fan_in_releases_its_child_once(queue: Queue) -> None:
    ran: list[int] = []

    @queue.task()
    async def part(job: Job) -> int:
        return int(job.payload["i"])

    @queue.task()
    async def report(job: Job) -> int:
        ran.append(job.id)
        return sum(v for v in job.parent_results.values())

    wf = queue.workflow()
    parts = [wf.add(part, {"i": i}) for i in range(500)]
    wf.add(report, {}, after=parts)
    ids = await wf.enqueue()
    async with running(_worker(queue, concurrency=50)), running(_worker(queue, concurrency=50)):
        assert await queue.result(ids[-1], timeout=60) == sum(range(500))
    assert ran == [ids[-1]]
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps WHERE child_id = %s",
                          ids[-1]) == 500


async def test_a_snoozed_parent_keeps_its_child_waiting(queue: Queue) -> None:
    @queue.task()
    async def snoozes(job: Job) -> str:
        if job.attempt == 1:
            raise Retry(0)
        return "late"

    @queue.task()
    async def then(job: Job) -> Any:
        return job.parent_results

    parent = await snoozes.enqueue({})
    child = await then.enqueue({}, after=[parent])
    async with running(_worker(queue)):
        # JSON object keys are strings: the child's dict of ids comes back keyed by text.
        assert await queue.result(child, timeout=20) == {str(parent): "late"}


@pytest.mark.processes
async def test_cli_and_dashboard_show_waiting_jobs_and_their_family(
        queue: Queue, pg_dsn: str) -> None:
    from test_dashboard import client, token_in

    from asyncjobq.dashboard import create_app

    wf = queue.workflow()
    a = wf.add("t.a", {}, delay=3600)
    b = wf.add("t.b", {}, after=[a])
    wf.add("t.c", {}, after=[a, b])
    ids = await wf.enqueue()
    r = run_cli("status", "--schema", queue.schema, dsn=pg_dsn, env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if "waiting" in line)
    row = next(line for line in r.stdout.splitlines() if line.strip("│ ").startswith("default"))
    cells = [c.strip() for c in row.split("│")[1:-1]]
    names = [c.strip() for c in header.split("┃")[1:-1]]
    assert dict(zip(names, cells, strict=True))["waiting"] == "2", (names, cells)
    r = run_cli("get", str(ids[2]), "--schema", queue.schema, dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["status"], got["parents"], got["children"]) == ("waiting", ids[:2], [])
    async with client(create_app(queue)) as c:
        page = (await c.get(f"/jobs/{ids[1]}")).text
        assert "st-waiting" in page
        assert f'href="/jobs/{ids[0]}"' in page and f'href="/jobs/{ids[2]}"' in page
        listing = (await c.get("/jobs?status=waiting")).text
        assert f'href="/jobs/{ids[1]}"' in listing and f'href="/jobs/{ids[0]}"' not in listing
        r2 = await c.post(f"/jobs/{ids[1]}/cancel", data={"csrf_token": token_in(page)})
        assert r2.status_code in (302, 303), r2.text
    assert await _statuses(queue, ids) == ["queued", "cancelled", "cancelled"]


async def test_a_chain_cancelled_thousands_deep_stays_within_the_stack(queue: Queue) -> None:
    @queue.task()
    async def step(job: Job) -> None:
        return None

    wf = queue.workflow()
    head = prev = wf.add(step, delay=3600)
    for _ in range(3000):
        prev = wf.add(step, after=[prev])
    ids = await wf.enqueue()
    assert head.index == 0 and prev.index == 3000
    assert await queue.cancel(ids[0])
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 0
    assert (await queue.stats())["default"]["cancelled"] == 3001
    last = await queue.get(ids[-1])
    assert last is not None and last.last_error == f"parent {ids[-2]} was cancelled"


async def test_a_retried_dead_letter_parent_counts_once(queue: Queue) -> None:
    """A child that runs whatever its parents do, after A and B: A is dead-lettered (one of
    two counted), retried and done (not counted again): the child waits for B still."""
    runs: list[int] = []

    @queue.task(max_attempts=1)
    async def first(job: Job) -> str:
        runs.append(job.id)
        if len(runs) == 1:
            raise Fail("broken")
        return "a"

    @queue.task()
    async def step(job: Job) -> Any:
        return sorted(str(v) for v in job.parent_results.values())

    a = await first.enqueue({})
    b = await step.enqueue({}, delay=3600)
    child = await step.enqueue({}, after=[a, b], on_parent_failure="run")
    await drain(queue)
    assert await _statuses(queue, [a, b, child]) == ["failed", "queued", "waiting"]
    assert await queue.retry(a)
    await drain(queue)
    assert await _statuses(queue, [a, b, child]) == ["done", "queued", "waiting"]
    await execute(queue, "UPDATE {s}.jobs SET run_at = now() WHERE id = %s", b)
    await drain(queue)
    info = await queue.get(child)
    assert info is not None and info.status == "done", info
    # A's retry ended done: its result is what the child reads.
    assert info.result == ["[]", "a"]  # B returned [], the retried A "a"


async def test_an_open_producer_transaction_holds_up_no_worker(queue: Queue) -> None:
    """A job enqueued after a running parent in a transaction left open: the parent's worker
    renews its leases and writes the parent's outcome meanwhile; the commit then releases the
    child."""
    go = asyncio.Event()

    @queue.task()
    async def parent(job: Job) -> str:
        await go.wait()
        return "p"

    @queue.task()
    async def child(job: Job) -> Any:
        return job.parent_results

    p = await parent.enqueue({})

    async def locked_at() -> Any:
        return await fetchval(queue, "SELECT locked_at FROM {s}.jobs WHERE id = %s", p)

    async with running(_worker(queue, lease=1.5)):
        await wait_for(lambda: status_is(queue, p, "running"))
        async with queue.connection() as conn:
            async with conn.transaction():
                c = await child.enqueue({}, after=[p], conn=conn)
                first = await locked_at()

                async def renewed() -> bool:
                    return bool(await locked_at() > first)

                await wait_for(renewed, timeout=10, what="the parent's lease renewed")
                go.set()
                assert (await queue.wait(p, timeout=20)).status == "done"
            # Committed after the parent was done: the child is released by the commit.
        assert await queue.result(c, timeout=20) == {str(p): "p"}


async def test_a_workflow_commit_ended_by_a_deadlock_is_sent_again(
        queue: Queue, pg_dsn: str) -> None:
    """The commit of `enqueue(after=[a, b])` marks its parents in id order; another session
    that holds b and then wants a makes a deadlock, which PostgreSQL ends by rolling back the
    producer's statement (its deadlock_timeout passes first): it is sent again, and written
    once (_db/inserter.py, write)."""
    a = await queue.enqueue("t", {})
    b = await queue.enqueue("t", {})
    table = f'"{queue.schema}".jobs'
    with psycopg.connect(pg_dsn) as other:
        other.execute("SET deadlock_timeout = '30s'")  # the producer's check runs first
        other.execute(f"UPDATE {table} SET priority = priority WHERE id = %s", (b,))
        producer = asyncio.create_task(queue.enqueue("t", {}, after=[a, b]))

        async def producer_waits() -> bool:
            return bool(await fetchval(
                queue, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s USING (pid)"
                       " WHERE NOT l.granted AND position(%s in s.query) > 0"
                       " AND s.query LIKE '%%enqueue_workflow%%'", queue.schema))

        await wait_for(producer_waits, timeout=10, what="the producer waiting for b")
        # Wants a, which the producer's commit holds: a deadlock, the producer's to end.
        await asyncio.to_thread(
            other.execute, f"UPDATE {table} SET priority = priority WHERE id = %s", (a,))
        other.commit()
    child = await asyncio.wait_for(producer, timeout=30)
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs WHERE id = %s"
                                 " AND status = 'waiting'", child) == 1
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps WHERE child_id = %s",
                          child) == 2
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 3


async def test_conn_on_an_autocommit_connection_is_all_or_none(queue: Queue) -> None:
    @queue.task()
    async def step(job: Job) -> None:
        return None

    done_parent = await step.enqueue({})
    await drain(queue)
    async with queue.connection() as conn:  # autocommit, no transaction open
        assert conn.autocommit
        with pytest.raises(ConfigurationError, match="does not exist"):
            await step.enqueue({}, after=[done_parent, 999_999_999], conn=conn)
        ids = await queue.workflow().enqueue(conn=conn)
        assert ids == []
        wf = queue.workflow()
        wf.add(step, after=[done_parent])
        (child,) = await wf.enqueue(conn=conn)
    assert await fetchval(queue, "SELECT count(*) FROM {s}.jobs") == 1
    assert (await queue.get(child)).status == "queued"  # type: ignore[union-attr]


async def test_the_owners_functions_ignore_a_callers_temporary_tables(queue: Queue) -> None:
    """enqueue_workflow and the release run with their owner's rights: a caller's temporary
    table named like one of the schema's is never written instead (pg_temp is searched last)."""
    @queue.task()
    async def step(job: Job) -> None:
        return None

    async with queue.connection() as conn:
        await conn.execute("CREATE TEMP TABLE jobs (LIKE pg_class)")
        await conn.execute("CREATE TEMP TABLE job_deps (LIKE pg_class)")
        wf = queue.workflow()
        first = wf.add(step)
        wf.add(step, after=[first])
        ids = await wf.enqueue(conn=conn)
        cur = await conn.execute("SELECT count(*) FROM pg_temp.jobs")
        assert (await cur.fetchone()) == (0,)
    assert await _statuses(queue, ids) == ["queued", "waiting"]
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps") == 1


async def test_doctor_finds_waiting_jobs_no_parent_will_release(queue: Queue) -> None:
    from asyncjobq.doctor import diagnose

    @queue.task()
    async def step(job: Job) -> None:
        return None

    wf = queue.workflow()
    a = wf.add(step, delay=3600)
    wf.add(step, after=[a])
    ids = await wf.enqueue()
    [ok] = [f for f in (await diagnose(queue)).findings if f.check == "waiting"]
    assert ok.level == "ok"
    # The parent removed without its end applied (no row trigger fires for this).
    await execute(queue, "ALTER TABLE {s}.jobs DISABLE TRIGGER jobs_parent_ended_delete")
    await execute(queue, "DELETE FROM {s}.jobs WHERE id = %s", ids[0])
    await execute(queue, "ALTER TABLE {s}.jobs ENABLE TRIGGER jobs_parent_ended_delete")
    [found] = [f for f in (await diagnose(queue)).findings if f.check == "waiting"]
    assert found.level == "problem" and f"(ids {ids[1]})" in found.message, found
    assert "SET status = 'queued', pending = 0" in found.advice
    assert await queue.cancel(ids[1])
    [ok] = [f for f in (await diagnose(queue)).findings if f.check == "waiting"]
    assert ok.level == "ok"


async def test_conn_on_a_non_autocommit_connection_is_the_callers_to_commit(
        queue: Queue, pg_dsn: str) -> None:
    @queue.task()
    async def step(job: Job) -> None:
        return None

    parent = await step.enqueue({})
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:  # not autocommit
        # The first statement of the caller's transaction: theirs to commit or roll back.
        gone = await step.enqueue({}, after=[parent], conn=conn)
        await conn.rollback()
        assert await queue.get(gone) is None
        kept = await step.enqueue({}, after=[parent], conn=conn)
        await conn.commit()
    assert (await queue.get(kept)).status == "waiting"  # type: ignore[union-attr]


async def test_the_pruner_keeps_a_parent_while_its_child_is_live(queue: Queue) -> None:
    @queue.task()
    async def step(job: Job) -> int:
        return 7

    @queue.task()
    async def child(job: Job) -> Any:
        return job.parent_results

    wf = queue.workflow()
    a = wf.add(step)
    b = wf.add(step, delay=3600)
    wf.add(child, after=[a, b])
    ids = await wf.enqueue()
    await drain(queue)
    assert (await queue.get(ids[0])).status == "done"  # type: ignore[union-attr]
    await queue.prune(older_than=0.001)
    assert await queue.get(ids[0]) is not None  # its child waits for it still
    await execute(queue, "UPDATE {s}.jobs SET run_at = now() WHERE id = %s", ids[1])
    await drain(queue)
    assert (await queue.get(ids[2])).result == {str(ids[0]): 7, str(ids[1]): 7}  # type: ignore[union-attr]
    await queue.prune(older_than=0.001)
    assert [await queue.get(i) for i in ids] == [None, None, None]
    assert await fetchval(queue, "SELECT count(*) FROM {s}.job_deps") == 0


async def test_enqueue_workflow_takes_counts_from_the_edges_and_checks_them(
        queue: Queue) -> None:
    async def call(jobs: str, edges: str) -> Any:
        async with queue.connection() as conn:
            cur = await conn.execute(queue.sql.workflow_enqueue, (jobs, edges))
            return await cur.fetchall()

    job = '["t", {}, "default", 0, null, 0, 3, null, null]'
    for bad in ('[[1, null, 0, false]]', '[[0, null, 0, false]]', '[[null, null, 1, false]]',
                '[[0, 5, 1, false]]', '[[0, null, 2, false]]'):
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            await call(f"[{job}, {job}]", bad)
    # A caller's extra elements are not counts: the edges are.
    rows = await call(f'[{job[:-1]}, 0, true], {job}]', '[[0, null, 1, false]]')
    a, b = (int(r[0]) for r in rows)
    assert await _statuses(queue, [a, b]) == ["queued", "waiting"]
    assert await fetchval(queue, "SELECT array[pending, (dependents)::int] FROM {s}.jobs"
                                 " WHERE id = %s", b) == [1, None]
    assert await fetchval(queue, "SELECT dependents FROM {s}.jobs WHERE id = %s", a) is True
