"""Hostile input stays data, schema names are validated, passwords stay hidden, and the
least-privilege roles documented in docs/guides/roles.md work exactly as written. Real
PostgreSQL, no mocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
import pytest
from claims import CREATE_CLAIMS
from conftest import ROOT, execute, fetchval, run_cli, running, spawn_worker, wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo

import asyncjobq
from asyncjobq import Fail, Job, Queue, Worker
from asyncjobq._db.migrations import available

# {schema} is replaced by the test's schema, so a string that escaped into SQL would hit it.
HOSTILE = [
    "'); DROP TABLE {schema}.jobs; --",
    "\" OR 1=1 --",
    "x'; DELETE FROM {schema}.jobs WHERE 'a'='a",
    "$$; DROP TABLE {schema}.canary; $$",
    "$tag$ x $tag$",
    "%s %(task)s %% %b",
    "{} {s} {0} {schema!r}",
    "back\\slash \\' \\\\ \\x00 \\u0000",  # backslashes and the *text* of escapes, no NUL
    "日本語のキュー",
    "emoji 🎉🚀 ü",
    "tab\tnew\nline\r",
    "*/ /* -- ;",
]


def hostile(schema: str) -> list[str]:
    return [s.replace("{schema}", schema) for s in HOSTILE]


async def tables_intact(q: Queue) -> None:
    tables = await fetchval(
        q, "SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables"
           " WHERE schemaname = %s", q.schema)
    assert {"canary", "jobs", "jobs_history", "migrations"} <= set(tables), tables
    assert await fetchval(q, "SELECT count(*) FROM {s}.canary") == 1


# --- injection through the library -------------------------------------------------------------


async def test_hostile_names_and_payloads_round_trip_through_real_workers(queue: Queue) -> None:
    await execute(queue, "CREATE TABLE {s}.canary (x int); INSERT INTO {s}.canary VALUES (1)")
    names = hostile(queue.schema)
    seen: dict[int, tuple[str, str, dict[str, Any], str]] = {}

    def register(name: str) -> None:
        @queue.task(name=name, queue=name)
        async def handler(job: Job) -> None:
            seen[job.id] = (job.task, job.queue, job.payload, job.worker)

    for name in names:
        register(name)

    expected: dict[int, tuple[str, str, dict[str, Any]]] = {}
    for name in names:
        payload = {name: name, "nested": [name, {name: [name]}]}
        job_id = await queue.enqueue(name, payload, dedup_key=name)
        # The dedup re-read matches the hostile key exactly: the same job comes back.
        assert await queue.enqueue(name, {"other": 1}, dedup_key=name) == job_id
        expected[job_id] = (name, name, payload)
        payloads: list[dict[str, Any]] = [{name: 1}, {"k": name}]
        for many_id, p in zip(await queue.enqueue_many(name, payloads), payloads, strict=True):
            expected[many_id] = (name, name, p)
    assert await queue.stats() == {n: {"queued": 3, "running": 0, "done": 0, "failed": 0,
                                       "cancelled": 0} for n in names}

    # One worker on a single hostile queue (the equality claim), one on all the others (ANY()),
    # each named with a hostile string that ends up in locked_by.
    w_one = Worker(queue, queues=(names[0],), name=names[1], poll_interval=0.1)
    w_many = Worker(queue, queues=names[1:], name=names[0], poll_interval=0.1)
    async with running(w_one), running(w_many):
        await wait_for(lambda: len(seen) == len(expected), what="every hostile job to run")
        await wait_for(lambda: w_one.completed + w_many.completed == len(expected),
                       what="outcomes written")

    for job_id, (task, q, payload) in expected.items():
        got_task, got_queue, got_payload, worker = seen[job_id]
        assert (got_task, got_queue, got_payload) == (task, q, payload)
        assert worker == (w_one.id if q == names[0] else w_many.id)
        info = await queue.get(job_id)
        assert info is not None
        assert (info.task, info.queue, info.status, info.payload) == (task, q, "done", payload)
        locked_by = await fetchval(queue, "SELECT locked_by FROM {s}.jobs_history WHERE id = %s",
                                   job_id)
        assert locked_by == worker and locked_by.startswith(names[1] if q == names[0]
                                                            else names[0])
    await tables_intact(queue)


async def test_retry_failed_filters_are_data_not_sql(queue: Queue) -> None:
    await execute(queue, "CREATE TABLE {s}.canary (x int); INSERT INTO {s}.canary VALUES (1)")
    names = hostile(queue.schema)
    ids = {}
    for name in names:
        ids[name] = await queue.enqueue(name, {}, queue=name)
        await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = 3,"
                             " last_error = %s, finished_at = now() WHERE id = %s",
                      f"boom: {name}", ids[name])
    # Patterns that would match every row if they were pasted into the statement.
    for pattern in ["' OR '1'='1", "%' OR 1=1 --", "x') OR (1=1", "\" OR \"\"=\""]:
        assert await queue.retry_failed(error_like=pattern) == 0
        assert await queue.retry_failed(queue=pattern, task=pattern) == 0
    assert (await queue.stats())[names[0]]["failed"] == 1

    for name in names:
        # Exact equality on queue and task: only this job comes back.
        assert await queue.retry_failed(queue=name, task=name) == 1, name
        info = await queue.get(ids[name])
        assert info is not None and (info.status, info.attempts) == ("queued", 0)
    assert sum(c["failed"] for c in (await queue.stats()).values()) == 0

    # LIKE on a hostile (metacharacter-free) message matches literally.
    await execute(queue, "UPDATE {s}.jobs SET status = 'failed' WHERE queue = %s", names[1])
    assert await queue.retry_failed(error_like=f"boom: {names[1]}") == 1
    await tables_intact(queue)


async def test_sql_enqueue_function_with_hostile_arguments(queue: Queue) -> None:
    await execute(queue, "CREATE TABLE {s}.canary (x int); INSERT INTO {s}.canary VALUES (1)")
    for name in hostile(queue.schema):
        job_id = await fetchval(queue, "SELECT {s}.enqueue(%s, %s::jsonb, %s, dedup_key => %s)",
                                name, json.dumps({name: name}), name, name)
        assert await fetchval(queue, "SELECT {s}.enqueue(%s, dedup_key => %s)",
                              "other", name) == job_id
        info = await queue.get(int(job_id))
        assert info is not None and (info.task, info.queue, info.payload) == (
            name, name, {name: name})
    await tables_intact(queue)


# --- what PostgreSQL cannot store: refused with our error, before any I/O ----------------------


async def test_nul_and_unpaired_surrogates_are_refused_before_any_io(
        pg_dsn: str, schema: str) -> None:
    q = Queue(pg_dsn, schema=schema)  # never opened: an error here proves no I/O was needed
    for bad in ("a\x00b", "\ud800", "x\udcff"):
        for payload in ({"k": bad}, {bad: 1}, {"deep": [{"x": [bad]}]}):
            with pytest.raises(asyncjobq.InvalidPayloadError, match="cannot store"):
                await q.enqueue("t", payload)
            with pytest.raises(asyncjobq.InvalidPayloadError, match=r"payloads\[1\]"):
                await q.enqueue_many("t", [{}, payload])
        for kwargs in ({"queue": bad}, {"dedup_key": bad}):
            with pytest.raises(asyncjobq.ConfigurationError, match="NUL or unpaired surrogate"):
                await q.enqueue("t", {}, **kwargs)
        with pytest.raises(asyncjobq.ConfigurationError, match="NUL or unpaired surrogate"):
            await q.enqueue(bad, {})
        for kwargs in ({"queue": bad}, {"task": bad}, {"error_like": bad}):
            with pytest.raises(asyncjobq.ConfigurationError, match="NUL or unpaired surrogate"):
                await q.retry_failed(**kwargs)
        with pytest.raises(asyncjobq.ConfigurationError, match="worker name"):
            Worker(q, name=bad)
        with pytest.raises(asyncjobq.ConfigurationError):
            Worker(q, queues=(bad,))
        with pytest.raises(asyncjobq.ConfigurationError):
            q.task(name=bad)(lambda job: None)
    # The escaped *text* of a NUL is an ordinary string, and so are valid surrogate-free emoji.
    async with q:
        await q.install()
        job_id = await q.enqueue("t", {"text": "\\u0000", "emoji": "🎉"})
        info = await q.get(job_id)
        assert info is not None and info.payload == {"text": "\\u0000", "emoji": "🎉"}


@pytest.mark.processes
def test_invalid_utf8_on_the_command_line_is_refused_clearly(pg_dsn: str, schema: str) -> None:
    # Python hands undecodable argv bytes over as lone surrogates.
    r = run_cli("enqueue", "t\udcff", "--schema", schema, dsn=pg_dsn, timeout=30)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("asyncjobq: error: task 't\\udcff' is invalid"), r.stderr
    assert "Traceback" not in r.stderr


# --- schema names ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    'x"; DROP TABLE jobs; --', "x; DROP SCHEMA public CASCADE", "Upper", "MiXed_case",
    "a" * 49, "", "1starts_with_digit", "has-dash", "has space", "dot.ted", "quote'", "ünï",
    "a\x00b", "public\"", "$1",
])
def test_schema_names_are_validated(pg_dsn: str, bad: str) -> None:
    with pytest.raises(asyncjobq.ConfigurationError, match="is not a valid name"):
        Queue(pg_dsn, schema=bad)


@pytest.mark.processes
def test_hostile_schema_name_on_the_command_line_creates_nothing(pg_dsn: str) -> None:
    bads = ['x"; DROP TABLE jobs; --', "Upper", "a" * 49]
    for bad in bads:
        r = run_cli("install", "--schema", bad, dsn=pg_dsn, timeout=30)
        assert r.returncode == 2, (r.stdout, r.stderr)  # a usage mistake
        assert r.stderr.strip().splitlines()[-1] == (
            f"Error: Invalid value for '--schema': schema {bad!r} is not a valid name: use "
            "1-48 lower-case letters, digits or underscores, starting with a letter or "
            "underscore (e.g. schema='asyncjobq')")
        assert "Traceback" not in r.stderr
    # By name, not a count of all schemas: other sessions sharing a test server create and
    # drop theirs meanwhile.
    with psycopg.connect(pg_dsn) as conn:
        made = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)",
                            ([*bads, "x", "upper", "a" * 48],)).fetchall()
        assert made == []


# --- injection through the CLI -----------------------------------------------------------------


@pytest.mark.processes
async def test_hostile_strings_through_the_cli(queue: Queue, pg_dsn: str) -> None:
    await execute(queue, CREATE_CLAIMS)
    await execute(queue, "CREATE TABLE {s}.canary (x int); INSERT INTO {s}.canary VALUES (1)")
    names = hostile(queue.schema)
    picked = [names[0], names[3], names[5], names[8], names[9]]

    def cli(*args: str) -> str:
        r = run_cli(*args, "--schema", queue.schema, dsn=pg_dsn, timeout=30)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout

    ids = {}
    for name in picked:
        out = cli("enqueue", name, "--queue", name, "--payload", json.dumps({name: name}),
                  "--dedup-key", name)
        ids[name] = int(out)
        assert int(cli("enqueue", name, "--dedup-key", name)) == ids[name]
        info = await queue.get(ids[name])
        assert info is not None
        assert (info.task, info.queue, info.payload) == (name, name, {name: name})
    data = json.loads(cli("status", "--json"))
    assert set(data["queues"]) == set(picked)
    assert "requeued 0 failed job(s)" in cli("retry-failed", "--error-like", "' OR '1'='1")

    for name in picked:
        await execute(queue, "UPDATE {s}.jobs SET status = 'failed', last_error = %s"
                             " WHERE id = %s", f"boom {name}", ids[name])
    assert "requeued 0" in cli("retry-failed", "--queue", "x' OR '1'='1", "--task", "' OR 1=1 --")
    for name in picked:
        out = cli("retry-failed", "--queue", name, "--task", name, "--error-like", f"boom {name}")
        assert out.strip() == "requeued 1 failed job(s)", (name, out)

    # A worker process serving hostile queues (--queue twice: the ANY() claim) runs them.
    log_ids = [int(cli("enqueue", "log", "--queue", q)) for q in (names[0], names[8])]
    proc = spawn_worker(pg_dsn, queue.schema, "--queue", names[0], "--queue", names[8],
                        "--name", names[1])
    try:
        async def logged() -> bool:
            assert proc.poll() is None, proc.communicate()
            return await fetchval(queue, "SELECT count(*) FROM {s}.claims WHERE job_id ="
                                         " ANY(%s)", log_ids) == 2

        await wait_for(logged, timeout=30, what="the worker to run jobs on hostile queues")
        worker = await fetchval(queue, "SELECT worker FROM {s}.claims LIMIT 1")
        assert worker.startswith(names[1])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    await tables_intact(queue)


# --- passwords -----------------------------------------------------------------------------------


SECRET = "pw-Zq81xK"


def test_repr_and_errors_hide_the_password() -> None:
    for dsn in (f"postgresql://app:{SECRET}@db.example/app", f"host=db password={SECRET} user=a",
                f"postgresql://app:{SECRET}@db.example:notaport/app"):
        q = Queue(dsn, schema="asyncjobq")
        assert SECRET not in repr(q), repr(q)
        assert "***" in repr(q), repr(q)
    unreachable = Queue(f"postgresql://app:{SECRET}@127.0.0.1:1/app", connect_timeout=2)
    with pytest.raises(asyncjobq.DatabaseUnavailableError) as caught:
        asyncio.run(unreachable.open())
    assert SECRET not in str(caught.value) and "127.0.0.1" in str(caught.value)
    assert SECRET not in repr(unreachable)
    with pytest.raises(asyncjobq.ConfigurationError) as bad:
        Queue(f"password={SECRET} host=x port=nope", schema="asyncjobq").dsn  # noqa: B018
    assert SECRET not in str(bad.value)


@pytest.mark.processes
async def test_password_absent_from_logs_repr_and_status_of_a_working_setup(
        pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    # The test servers trust local connections, so the password is carried but never checked:
    # the DSN works and every place that could print it is exercised.
    dsn = make_conninfo(pg_dsn, password=SECRET)
    caplog.set_level(logging.DEBUG)
    q = Queue(dsn, schema=schema)

    @q.task(name="bad", max_attempts=1)
    async def bad(job: Job) -> None:
        raise RuntimeError(f"handler error on {job.id}")

    @q.task(name="ok")
    async def ok(job: Job) -> None:
        pass

    async with q:
        await q.install()
        assert SECRET not in repr(q)
        ids = [await bad.enqueue({}), await ok.enqueue({})]
        w = Worker(q, poll_interval=0.1, lease=3)
        async with running(w):
            async def both_finished() -> bool:
                infos = [await q.get(i) for i in ids]
                return [i.status if i else None for i in infos] == ["failed", "done"]

            await wait_for(both_finished, what="both jobs")
            # A lost LISTEN connection logs its reconnection.
            await wait_for(lambda: w.listener is not None and w.listener.backend_pid is not None,
                           what="LISTEN connected")
            assert w.listener is not None
            old_pid = w.listener.backend_pid
            await execute(q, "SELECT pg_terminate_backend(%s)", old_pid)
            await wait_for(lambda: w.listener is not None and w.listener.connects >= 2
                           and w.listener.backend_pid not in (None, old_pid),
                           timeout=10, what="LISTEN reconnected")
        info = await q.get(ids[0])
        assert info is not None and info.status == "failed"
    assert caplog.text, "nothing was logged"
    assert SECRET not in caplog.text
    assert all(SECRET not in str(r.args) for r in caplog.records)

    r = run_cli("status", "--schema", schema, "--dsn", dsn, timeout=30)
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout + r.stderr
    r = run_cli("status", "--json", "--schema", schema, dsn=dsn, timeout=30)
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout + r.stderr


# --- least-privilege roles, exactly as docs/guides/roles.md documents them ---------------------


@dataclass(frozen=True)
class Roles:
    owner: str
    producer: str
    worker: str
    superuser_sql: list[str]
    owner_sql: list[str]

    def all(self) -> tuple[str, str, str]:
        return self.owner, self.producer, self.worker


def documented_role_sql(schema: str, roles: dict[str, str], database: str) -> tuple[list[str],
                                                                                list[str]]:
    """The roles page's GRANT block, split into the superuser part and the owner part."""
    text = (ROOT / "docs" / "guides" / "roles.md").read_text()
    section = text.split("# Least-privilege roles", 1)[1]
    block = re.search(r"```sql\n(.*?)```", section, re.S)
    assert block, "docs/guides/roles.md has no sql block under 'Least-privilege roles'"
    parts = block.group(1).split("\n-- As asyncjobq_owner")
    assert len(parts) == 2, "the block has a superuser part, then one for asyncjobq_owner"

    def statements(part: str) -> list[str]:
        lines = [line for line in part.splitlines() if not line.lstrip().startswith("--")]
        body = "\n".join(lines)
        for doc_name, name in roles.items():
            body = re.sub(rf"\b{doc_name}\b", name, body)
        body = re.sub(r"\basyncjobq\.", f"{schema}.", body)
        body = re.sub(r"\bSCHEMA asyncjobq\b", f"SCHEMA {schema}", body)
        body = body.replace("ON DATABASE app ", f'ON DATABASE "{database}" ')
        assert "asyncjobq" not in body.replace(schema, ""), body
        return [s.strip() for s in body.split(";") if s.strip()]

    return statements(parts[0]), statements(parts[1].split("\n", 1)[1])


def documented_workflow_grant(schema: str, roles: Roles) -> list[str]:
    """The roles page's grant for producers of workflows, for this test's schema and roles."""
    text = (ROOT / "docs" / "guides" / "roles.md").read_text()
    section = text.split("## A role that enqueues workflows", 1)[1]
    block = re.search(r"```sql\n(.*?)```", section, re.S)
    assert block, "docs/guides/roles.md has no sql block for producers of workflows"
    body = re.sub(r"\basyncjobq_producer\b", roles.producer, block.group(1))
    body = re.sub(r"\basyncjobq\.", f"{schema}.", body)
    return [s.strip() for s in body.split(";") if s.strip()]


@pytest.fixture
def roles(pg_dsn: str, schema: str) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:8]
    names = {"asyncjobq_owner": f"ajq_owner_{suffix}", "asyncjobq_producer": f"ajq_prod_{suffix}",
             "asyncjobq_worker": f"ajq_work_{suffix}"}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
    superuser_sql, owner_sql = documented_role_sql(schema, names, row[0])
    r = Roles(names["asyncjobq_owner"], names["asyncjobq_producer"], names["asyncjobq_worker"],
              superuser_sql, owner_sql)
    try:
        yield r
    finally:
        # Roles are cluster-wide: drop what they own and hold, here, whatever the test did.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                         " WHERE datname = current_database()"
                         " AND usename = ANY(%s)", (list(r.all()),))
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))
            for role in r.all():
                exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                      (role,)).fetchone()
                if exists:
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


async def assert_denied(conn: psycopg.AsyncConnection[Any], schema: str, *queries: str) -> None:
    for query in queries:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)))  # type: ignore[arg-type]


@pytest.mark.processes
async def test_least_privilege_roles_as_documented(pg_dsn: str, schema: str,
                                                     roles: Roles) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in roles.superuser_sql:
            conn.execute(statement)  # type: ignore[call-overload]

    # Owner: installs, owns every object, grants the rest.
    async with Queue(as_role(pg_dsn, roles.owner), schema=schema) as owner:
        assert await owner.install() == [m.version for m in available()]
        owners = await fetchval(
            owner, "SELECT array_agg(DISTINCT tableowner::text) FROM pg_tables"
                   " WHERE schemaname = %s", schema)
        assert owners == [roles.owner]
        async with owner.connection() as conn:
            for statement in roles.owner_sql:
                await conn.execute(statement)  # type: ignore[call-overload]

    listener = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"{schema}_jobs")))

    # Producer: adds jobs every documented way, and can do nothing else to them.
    producer = Queue(as_role(pg_dsn, roles.producer), schema=schema)
    async with producer:
        first = await producer.enqueue("ok", {"n": 1}, queue="roles")
        notes = [n async for n in listener.notifies(timeout=5.0, stop_after=1)]
        assert len(notes) == 1 and json.loads(notes[0].payload)["queue"] == "roles"
        many = await producer.enqueue_many("ok", [{"n": 2}, {"n": 3}], queue="roles")
        notes = [n async for n in listener.notifies(timeout=5.0, stop_after=1)]
        assert len(notes) == 1, "one notification per statement"
        # Granted INSERT on the partitions, its batches name them (inserter.PartitionWriter).
        assert producer._partitions is not None and producer._partitions.usable
        keyed = await producer.enqueue_many("ok", [{"n": 7}, {"n": 8}], queue="roles",
                                            keys=["account:1", "account:1"])
        dedup = await producer.enqueue("ok", {"n": 4}, queue="roles", dedup_key="once")
        assert await producer.enqueue("ok", {"n": 5}, queue="roles", dedup_key="once") == dedup
        async with producer.connection() as conn:
            cur = await conn.execute(sql.SQL("SELECT {}.enqueue('ok', '{{\"n\": 6}}', 'roles')")
                                     .format(sql.Identifier(schema)))
            row = await cur.fetchone()
            assert row is not None
            by_sql = int(row[0])
            async with conn.transaction():
                in_tx = await producer.enqueue("boom", {}, queue="roles", conn=conn)
            await assert_denied(conn, schema, "UPDATE {s}.jobs SET priority = 9",
                                "DELETE FROM {s}.jobs", "SELECT payload FROM {s}.jobs",
                                "TRUNCATE {s}.jobs", "SELECT * FROM {s}.jobs_history",
                                "CREATE TABLE {s}.evil (x int)")
        with pytest.raises(asyncjobq.AsyncJobQError, match=r"may not install.*owner"):
            await producer.install()
        # Workflows: refused until the grant roles.md documents for them, then enqueued.
        with pytest.raises(asyncjobq.EnqueueRefusedError, match=r"permission denied.*"
                           r"EXECUTE ON FUNCTION .*\.enqueue_workflow\(jsonb, jsonb\)"):
            await producer.enqueue("ok", {"n": 9}, queue="roles", after=[first])
        async with await psycopg.AsyncConnection.connect(
                as_role(pg_dsn, roles.owner), autocommit=True) as conn:
            for statement in documented_workflow_grant(schema, roles):
                await conn.execute(statement)  # type: ignore[call-overload]
        wf = producer.workflow()
        step = wf.add("ok", {"n": 10}, queue="roles", after=[first])
        wf.add("ok", {"n": 11}, queue="roles", after=[step, *many])
        flow_ids = await wf.enqueue()
        async with producer.connection() as conn:
            await assert_denied(conn, schema, "INSERT INTO {s}.job_deps VALUES (1, 2)",
                                "SELECT {s}.job_deps_settle(ARRAY[1]::bigint[], 'done', 1)")
    # A producer granted INSERT on jobs alone (roles.md before this release) inserts through
    # jobs.
    async with Queue(as_role(pg_dsn, roles.owner), schema=schema) as owner:
        await execute(owner, f"REVOKE INSERT ON {{s}}.jobs_1 FROM {roles.producer}")
    async with Queue(as_role(pg_dsn, roles.producer), schema=schema) as narrow:
        routed = await narrow.enqueue_many("ok", [{"n": 12}], queue="roles")
        assert narrow._partitions is not None and narrow._partitions.usable is False
    job_ids = [first, *many, *keyed, dedup, by_sql, in_tx, *flow_ids, *routed]

    # Worker: runs them (done, retried, failed), admin calls work, no DDL.
    wq = Queue(as_role(pg_dsn, roles.worker), schema=schema)

    # Limited: every claim goes through flow_admit and its log of starts, as the worker role.
    # Declared on the worker's queue: a worker sends only its own queues' limits.
    @wq.task(name="ok", queue="roles", concurrency_limit=5, key_limit=1, rate_limit="1000/s")
    async def ok(job: Job) -> None:
        pass

    @wq.task(name="boom", max_attempts=2, backoff=lambda n: 0.05)
    async def boom(job: Job) -> None:
        if job.attempt == 1:
            raise RuntimeError("first attempt fails")
        raise Fail("second attempt gives up")

    async with wq:
        w = Worker(wq, queues=("roles",), poll_interval=0.1, vacuum_interval=0.1)
        async with running(w):
            async def finished() -> bool:
                infos = [await wq.get(i) for i in job_ids]
                return all(i is not None and i.status in ("done", "failed") for i in infos)

            await wait_for(finished, what="the worker role to finish every job")
            # Not the table's owner: it may not vacuum, so it leaves that to autovacuum.
            await wait_for(lambda: w.vacuum is not None and w.vacuum.disabled,
                           what="the worker role to leave vacuum to autovacuum")
        statuses = {i: info.status for i in job_ids if (info := await wq.get(i))}
        assert statuses == {**dict.fromkeys(job_ids, "done"), in_tx: "failed"}
        assert await wq.retry_failed(queue="roles") == 1
        assert await wq.cancel(in_tx)
        assert (await wq.stats())["roles"]["cancelled"] == 1
        # Pause and resume as the worker role: its grants, and pg_locks readable by any role.
        assert await wq.pause("roles") is True
        assert list(await wq.paused()) == ["roles"]
        assert await wq.resume("roles") is True
        with pytest.raises(asyncjobq.AsyncJobQError, match=r"may not install.*owner"):
            await wq.install()
        async with wq.connection() as conn:
            await assert_denied(conn, schema, "CREATE TABLE {s}.evil (x int)",
                                "DROP TABLE {s}.jobs", "ALTER TABLE {s}.jobs ADD COLUMN evil int",
                                "TRUNCATE {s}.jobs", "CREATE INDEX evil ON {s}.jobs (task)",
                                "INSERT INTO {s}.migrations (version, name) VALUES (998, 'x')")

    # The CLI as each role: status works for the worker; install is refused with one line.
    r = run_cli("status", "--json", "--schema", schema, dsn=as_role(pg_dsn, roles.worker))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["queues"]["roles"]["cancelled"] == 1
    for role in (roles.worker, roles.producer):
        r = run_cli("install", "--schema", schema, dsn=as_role(pg_dsn, role))
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert r.stderr.startswith("asyncjobq: error: this role may not install schema"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    await listener.close()
