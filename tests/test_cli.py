"""`python -m asyncjobq ...` as users run it: real subprocesses against a real PostgreSQL.

Every mistake must end with the documented exit code (2 usage, 1 runtime) and a short message on
stderr that says what to do: never a traceback, never a password.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from typing import Any

import psycopg
import pytest
from claims import CREATE_CLAIMS
from conftest import execute, fetchval, run_cli, spawn_worker, wait_for
from psycopg import sql

from asyncjobq import Queue
from asyncjobq._db import migrations
from asyncjobq._db.sql.common import count_history

# Each test starts processes: worker or CLI processes, or a server of its own.
pytestmark = pytest.mark.processes

UNREACHABLE = "postgresql://postgres@127.0.0.1:1/postgres"
SECRET = "s3cretpw"
# (DSN, exit code when given as --dsn): a malformed --dsn is a usage mistake; the same DSN in
# $ASYNCJOBQ_DSN is a runtime one (1), as every unreachable server is.
SECRET_DSNS = [
    (f"postgresql://postgres:{SECRET}@127.0.0.1:1/postgres", 1),  # unreachable
    (f"postgresql://postgres:{SECRET}@127.0.0.1:notaport/postgres", 2),  # bad port
    (f"host=127.0.0.1 port=1 password={SECRET}", 1),  # key=value, unreachable
    (f"password={SECRET} host=x port=notanumber =", 2),  # malformed
]


def assert_clean_error(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """Exit `code`, no traceback, a short stderr that contains every needle (case-insensitive)."""
    both = r.stdout + r.stderr
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in both, both
    err = r.stderr.strip()
    assert err, "no message on stderr"
    lines = err.splitlines()
    if code == 1:
        # Runtime failures: exactly one line, ours.
        assert len(lines) == 1, lines
        assert lines[0].startswith("asyncjobq: error: "), lines
    else:
        # Usage errors: click's usage line, the "Try --help" hint and one error line.
        assert len(lines) <= 4, lines
        assert lines[-1].startswith("Error: "), lines
    for needle in needles:
        assert needle.lower() in err.lower(), (needle, err)


def cli(schema: str, *args: str, dsn: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--schema", schema, dsn=dsn, **kw)


# --- install ---------------------------------------------------------------------------------


def test_install_applies_then_reports_up_to_date(pg_dsn: str, schema: str) -> None:
    first = cli(schema, "install", dsn=pg_dsn)
    assert first.returncode == 0, first.stderr
    versions = ", ".join(str(m.version) for m in migrations.available())
    assert first.stdout.strip() == f"schema {schema}: applied migrations {versions}", first.stdout
    with psycopg.connect(pg_dsn) as conn:
        tables = conn.execute(
            "SELECT array_agg(table_name::text ORDER BY table_name) FROM information_schema.tables"
            " WHERE table_schema = %s", (schema,)).fetchone()
    assert tables is not None
    assert {"jobs", "jobs_history", "migrations"} <= set(tables[0])

    second = cli(schema, "install", dsn=pg_dsn)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == f"schema {schema}: up to date", second.stdout
    assert "Traceback" not in first.stderr + second.stderr


# --- enqueue ---------------------------------------------------------------------------------


async def test_enqueue_reads_a_large_payload_from_a_file_or_stdin(
        queue: Queue, pg_dsn: str, tmp_path: Any) -> None:
    # 1 MB: far past the 128 KiB Linux allows one command-line argument.
    payload = {"blob": "x" * 1_000_000, "name": "キュー"}
    path = tmp_path / "payload.json"
    path.write_text(json.dumps(payload, ensure_ascii=False), "utf-8")
    from_file = cli(queue.schema, "enqueue", "big", "--payload", f"@{path}", dsn=pg_dsn)
    assert from_file.returncode == 0, from_file.stderr
    from_stdin = cli(queue.schema, "enqueue", "big", "--payload", "-", dsn=pg_dsn,
                     input=json.dumps(payload))
    assert from_stdin.returncode == 0, from_stdin.stderr
    for r in (from_file, from_stdin):
        assert await fetchval(queue, "SELECT payload FROM {s}.jobs WHERE id = %s",
                              int(r.stdout)) == payload
    bad = cli(queue.schema, "enqueue", "big", "--payload", "-", dsn=pg_dsn, input="[1]")
    assert_clean_error(bad, 2, "must be a JSON object, got an array")


async def test_enqueue_prints_id_and_writes_the_options(queue: Queue, pg_dsn: str) -> None:
    payload = {"to": "a@example.com", "n": 3, "tags": ["x", "y"]}
    r = cli(queue.schema, "enqueue", "send_email", "--payload", json.dumps(payload),
            "--queue", "mail", "--priority", "7", "--delay", "120", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"\d+\n", r.stdout), r.stdout
    job_id = int(r.stdout)

    info = await queue.get(job_id)
    assert info is not None
    assert (info.task, info.queue, info.priority, info.status, info.attempts) == (
        "send_email", "mail", 7, "queued", 0)
    assert await fetchval(queue, "SELECT payload FROM {s}.jobs WHERE id = %s", job_id) == payload
    delay = await fetchval(
        queue, "SELECT extract(epoch FROM run_at - created_at)::float8 FROM {s}.jobs WHERE id = %s",
        job_id)
    assert delay == pytest.approx(120, abs=1)

    # Defaults: queue "default", priority 0, due now, payload {}.
    r = cli(queue.schema, "enqueue", "plain", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    plain = await queue.get(int(r.stdout))
    assert plain is not None
    assert (plain.task, plain.queue, plain.priority) == ("plain", "default", 0)
    assert await fetchval(queue, "SELECT run_at <= now() FROM {s}.jobs WHERE id = %s", plain.id)
    assert await fetchval(queue, "SELECT payload FROM {s}.jobs WHERE id = %s", plain.id) == {}


# --- status ----------------------------------------------------------------------------------


async def _populate_for_status(q: Queue) -> None:
    """alpha: 2 queued, 1 running (stale), 1 done, 1 failed, 1 cancelled; beta: 1 delayed."""
    ids = [await q.enqueue("t", {"i": i}, queue="alpha") for i in range(6)]
    await execute(q, "UPDATE {s}.jobs SET status = 'running', attempts = 1, locked_by = 'w',"
                     " locked_at = now() - interval '1 hour' WHERE id = %s", ids[2])
    await execute(q, "UPDATE {s}.jobs SET status = 'failed', attempts = 3, last_error = 'boom',"
                     " finished_at = now() WHERE id = %s", ids[3])
    assert await q.cancel(ids[4])
    # Cancelled two minutes ago: out of the last-minute throughput whatever it counts.
    await execute(q, "UPDATE {s}.jobs_history SET finished_at = now() - interval '2 minutes'"
                     " WHERE id = %s", ids[4])
    # Done by hand, and counted as asyncjobq's completions count (0010_history_counted.sql).
    await execute(
        q, "WITH d AS (DELETE FROM {s}.jobs WHERE id = %s RETURNING *),"
           " ins AS (INSERT INTO {s}.jobs_history (id, queue, task, payload, status, priority,"
           "   run_at, attempts, max_attempts, created_at, finished_at)"
           " SELECT id, queue, task, payload, 'done', priority, run_at, 1, max_attempts,"
           "   created_at, now() FROM d RETURNING queue, status),"
           f" counted AS ({count_history('ins')}) SELECT count(*) FROM ins", ids[5])
    await q.enqueue("t", {}, queue="beta", delay=3600)


async def test_status_json_counts_every_status_per_queue(queue: Queue, pg_dsn: str) -> None:
    await _populate_for_status(queue)
    r = cli(queue.schema, "status", "--json", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["queues"] == {
        "alpha": {"queued": 2, "running": 1, "done": 1, "failed": 1, "cancelled": 1},
        "beta": {"queued": 1, "running": 0, "done": 0, "failed": 0, "cancelled": 0},
    }
    alpha, beta = data["health"]["alpha"], data["health"]["beta"]
    assert alpha["stale_running"] == 1  # locked_at an hour ago, lease 30 s
    assert alpha["done_last_minute"] == 1
    assert 0 <= alpha["oldest_queued_age_s"] < 60
    assert beta["oldest_queued_age_s"] is None  # its only job is not due for an hour
    assert beta["stale_running"] == 0

    # A longer lease: the hour-old heartbeat is no longer stale.
    r = cli(queue.schema, "status", "--json", "--lease", "7200", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["health"]["alpha"]["stale_running"] == 0


async def test_status_prints_a_table(queue: Queue, pg_dsn: str) -> None:
    await _populate_for_status(queue)
    r = cli(queue.schema, "status", dsn=pg_dsn, env={"COLUMNS": "160"})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "queue" in line and "queued" in line)
    for col in ("running", "done", "failed", "cancelled", "stale", "done/min"):
        assert col in header, header
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] in ("alpha", "beta"):
            rows[cells[0]] = cells
    assert rows["alpha"][1:6] == ["2", "1", "1", "1", "1"], rows
    assert rows["alpha"][7:] == ["1", "1"]  # stale running, done/min
    assert rows["beta"][1:6] == ["1", "0", "0", "0", "0"], rows
    assert rows["beta"][6] == "-"  # nothing due


def test_status_of_an_empty_schema(pg_dsn: str, schema: str) -> None:
    assert cli(schema, "install", dsn=pg_dsn).returncode == 0
    r = cli(schema, "status", "--json", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["queues"] == {}
    r = cli(schema, "status", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert "no jobs yet" in r.stdout


# --- cancel ----------------------------------------------------------------------------------


async def test_cancel_queued_job_then_again_fails(queue: Queue, pg_dsn: str) -> None:
    job_id = await queue.enqueue("t", {})
    keep = await queue.enqueue("t", {})
    r = cli(queue.schema, "cancel", str(job_id), dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert str(job_id) in r.stdout
    info = await queue.get(job_id)
    assert info is not None and info.status == "cancelled"
    other = await queue.get(keep)
    assert other is not None and other.status == "queued"

    again = cli(queue.schema, "cancel", str(job_id), dsn=pg_dsn)
    assert_clean_error(again, 1, f"job {job_id}", "not queued")
    unknown = cli(queue.schema, "cancel", "987654321", dsn=pg_dsn)
    assert_clean_error(unknown, 1, "job 987654321", "not queued")


async def test_cancel_of_a_running_job_is_asked_of_its_worker(queue: Queue, pg_dsn: str) -> None:
    job_id = await queue.enqueue("t", {})
    await execute(queue, "UPDATE {s}.jobs SET status = 'running', attempts = 1, locked_by = 'w',"
                         " locked_at = now() WHERE id = %s", job_id)
    r = cli(queue.schema, "cancel", str(job_id), dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"cancel of running job {job_id} requested")
    info = await queue.get(job_id)
    assert info is not None and info.status == "running" and info.cancel_requested
    r = cli(queue.schema, "get", str(job_id), dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert (shown["id"], shown["status"], shown["cancel_requested"]) == (job_id, "running", True)
    r = cli(queue.schema, "get", "99999999", dsn=pg_dsn)
    assert_clean_error(r, 1, "not found")


# --- retry-failed ----------------------------------------------------------------------------


async def test_retry_failed_requeues_and_filters(queue: Queue, pg_dsn: str) -> None:
    errors = ["TimeoutError: slow", "ValueError: bad", "TimeoutError: slower"]
    failed = [await queue.enqueue("t", {"i": i}) for i in range(3)]
    for job_id, error in zip(failed, errors, strict=True):
        await execute(queue, "UPDATE {s}.jobs SET status = 'failed', attempts = 3,"
                             " last_error = %s, finished_at = now() WHERE id = %s", error, job_id)
    queued = await queue.enqueue("t", {})

    r = cli(queue.schema, "retry-failed", "--task", "other", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "requeued 0 failed job(s)"

    r = cli(queue.schema, "retry-failed", "--error-like", "TimeoutError%", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "requeued 2 failed job(s)"
    states = {i: await queue.get(i) for i in [*failed, queued]}
    assert {i: (s.status, s.attempts) for i, s in states.items() if s} == {
        failed[0]: ("queued", 0), failed[1]: ("failed", 3), failed[2]: ("queued", 0),
        queued: ("queued", 0)}

    r = cli(queue.schema, "retry-failed", dsn=pg_dsn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "requeued 1 failed job(s)"
    assert (await queue.stats())["default"] == {
        "queued": 4, "running": 0, "done": 0, "failed": 0, "cancelled": 0}


# --- mistakes --------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "code", "needles"), [
    (["worker", "nosuchmodule:queue"], 1, ["cannot import 'nosuchmodule'", "PYTHONPATH"]),
    (["worker", "apps.nosuch:queue"], 1, ["cannot import 'apps.nosuch'", "PYTHONPATH"]),
    (["worker", "apps.testapp"], 2, ["'APP'", "'apps.testapp' is not module:attribute",
                                     "myapp.jobs:queue"]),
    (["worker", "apps.testapp:"], 2, ["not module:attribute"]),
    (["worker", ":queue"], 2, ["not module:attribute"]),
    (["worker", "apps.testapp:nope"], 1, ["has no attribute 'nope'", "apps.testapp:queue"]),
    (["worker", "apps.notaqueue:queue"], 1, ["is an int, not an asyncjobq.Queue",
                                             "asyncjobq.Queue(...)"]),
    (["worker", "apps.testapp:log_job"], 1, ["is a Task, not an asyncjobq.Queue"]),
    (["worker", "apps.broken:queue"], 1, ["RuntimeError: broken on purpose", "broken.py:3",
                                          "fix the module"]),
    # The module exists; an import inside it does not: say that, not "cannot import apps.baddep".
    (["worker", "apps.baddep:queue"], 1, ["importing 'apps.baddep' failed",
                                          "No module named 'apps.bad'", "fix the import"]),
    (["worker", "apps.testapp:queue", "--concurrency", "0"], 2, ["--concurrency", "x>=1"]),
    (["worker", "apps.testapp:queue", "--batch", "-1"], 2, ["--batch", "x>=1"]),
    (["worker", "apps.testapp:queue", "--lease", "0"], 2, ["--lease", "x>0"]),
    (["worker"], 2, ["Missing argument 'APP'"]),
    (["enqueue", "t", "--payload", "{bad"], 2, ["--payload", "not valid JSON",
                                                "pass an object like"]),
    (["enqueue", "t", "--payload", "[1, 2]"], 2, ["--payload",
                                                  "must be a JSON object, got an array",
                                                  "wrap it"]),
    (["enqueue", "t", "--payload", "42"], 2, ["must be a JSON object, got a number"]),
    # Python's json takes NaN and Infinity; JSON (and jsonb) do not: a usage mistake too.
    (["enqueue", "t", "--payload", '{"x": NaN}'], 2, ["--payload", "contains NaN",
                                                      "use a finite number"]),
    (["enqueue", "t", "--payload", '{"x": -Infinity}'], 2, ["contains -Infinity"]),
    (["enqueue", "t", "--payload", "@/nonexistent/payload.json"], 2, [
        "--payload", "cannot read '/nonexistent/payload.json'", "readable UTF-8 file"]),
    (["enqueue", "t", "--priority", "high"], 2, ["--priority", "not a valid integer"]),
    (["enqueue", "t", "--delay", "-1"], 2, ["--delay"]),
    (["cancel", "abc"], 2, ["ID"]),
    (["cancel", "0"], 2, ["ID", "x>=1"]),
    (["nosuchcommand"], 2, ["No such command 'nosuchcommand'"]),
    (["status", "--schema", "Bad-Name"], 2, ["schema 'Bad-Name' is not a valid name",
                                            "lower-case"]),
])
def test_mistakes_exit_with_a_short_message(pg_dsn: str, args: list[str], code: int,
                                            needles: list[str]) -> None:
    # A real database behind it: if a check were missing the command would run (and a worker
    # would hang until the timeout), not fail the way asserted here.
    r = run_cli(*args, dsn=pg_dsn, env={"ASYNCJOBQ_TEST_SCHEMA": "t_never_installed"},
                timeout=30)
    assert_clean_error(r, code, *needles)


@pytest.mark.parametrize("args", [
    ["install"], ["status"], ["enqueue", "t"], ["cancel", "1"], ["retry-failed"],
    ["worker", "apps.testapp:queue"],
])
def test_unreachable_database(args: list[str]) -> None:
    started = time.monotonic()
    r = run_cli(*args, "--dsn", UNREACHABLE, timeout=30)
    assert_clean_error(r, 1, "cannot connect to PostgreSQL", "127.0.0.1", "port=1",
                       "check that the server is running", "--dsn")
    assert time.monotonic() - started < 20  # fails fast, not after a pool timeout


@pytest.mark.parametrize("args", [["status"], ["enqueue", "t"], ["worker", "apps.testapp:queue"]])
def test_malformed_dsn(args: list[str]) -> None:
    r = run_cli(*args, "--dsn", "host=x port=notanumber =", timeout=30)
    assert_clean_error(r, 2, "'--dsn'", "is malformed", "invalid connection option",
                       "postgresql://user@host:5432/dbname")
    # libpq parses a non-numeric port and would only refuse it when connecting.
    r = run_cli(*args, "--dsn", "host=127.0.0.1 port=notanumber", timeout=30)
    assert_clean_error(r, 2, "'--dsn'", "port 'notanumber' is not a number")


def test_malformed_dsn_from_environment() -> None:
    r = run_cli("status", dsn="host=x port=notanumber =", timeout=30)
    assert_clean_error(r, 1, "is malformed")
    r = run_cli("status", dsn="postgresql://u@h:notaport/db", timeout=30)
    assert_clean_error(r, 1, "is malformed", "port 'notaport' is not a number")


@pytest.mark.parametrize("args", [
    ["enqueue", "t"], ["status"], ["status", "--json"], ["retry-failed"], ["cancel", "1"],
])
def test_schema_not_installed(pg_dsn: str, schema: str, args: list[str]) -> None:
    r = run_cli(*args, "--schema", schema, dsn=pg_dsn, timeout=30)
    assert_clean_error(r, 1, f"schema {schema} is not installed", "asyncjobq install")
    with psycopg.connect(pg_dsn) as conn:  # and nothing was created on the way
        assert conn.execute("SELECT to_regnamespace(%s)", (schema,)).fetchone() == (None,)


def test_worker_against_schema_not_installed(pg_dsn: str, schema: str) -> None:
    r = run_cli("worker", "apps.testapp:queue", dsn=pg_dsn,
                env={"ASYNCJOBQ_TEST_SCHEMA": schema}, timeout=30)
    assert_clean_error(r, 1, f"schema {schema} is not installed", "asyncjobq install")


@pytest.mark.parametrize(("dsn", "option_code"), SECRET_DSNS)
@pytest.mark.parametrize("args", [["status"], ["enqueue", "t"], ["worker", "apps.testapp:queue"]])
def test_password_never_printed(dsn: str, option_code: int, args: list[str]) -> None:
    for r, code in ((run_cli(*args, "--dsn", dsn, timeout=30), option_code),  # command line
                    (run_cli(*args, dsn=dsn, timeout=30), 1)):  # in $ASYNCJOBQ_DSN
        assert_clean_error(r, code)
        assert SECRET not in r.stdout + r.stderr, r.stderr


# --- worker ----------------------------------------------------------------------------------


async def test_worker_runs_a_job_and_exits_0_on_sigterm(queue: Queue, pg_dsn: str) -> None:
    await execute(queue, CREATE_CLAIMS)
    elsewhere = await queue.enqueue("log", {}, queue="elsewhere")
    proc = spawn_worker(pg_dsn, queue.schema, "--queue", "work", "--concurrency", "2",
                        "--lease", "10")
    try:
        r = cli(queue.schema, "enqueue", "log", "--queue", "work", "--payload", '{"n": 1}',
                dsn=pg_dsn)
        assert r.returncode == 0, r.stderr
        job_id = int(r.stdout)

        async def done() -> bool:
            info = await queue.get(job_id)
            assert proc.poll() is None, proc.communicate()
            return info is not None and info.status == "done"

        await wait_for(done, timeout=30, what="the worker to run the job")
        assert await fetchval(queue, "SELECT count(*) FROM {s}.claims WHERE job_id = %s",
                              job_id) == 1
        assert await fetchval(queue, "SELECT pid FROM {s}.claims WHERE job_id = %s",
                              job_id) == proc.pid
        # --queue work: the job on another queue is left alone.
        other = await queue.get(elsewhere)
        assert other is not None and (other.status, other.attempts) == ("queued", 0)

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


# --- demo ------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_demo_runs_end_to_end(pg_dsn: str) -> None:
    try:
        r = run_cli("demo", "--jobs", "200", "--workers", "1", "--dsn", pg_dsn, timeout=150)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        assert "outcomes" in r.stdout
        rows = re.findall(r"│\s*(done|failed)\s*│\s*(\d+)\s*│\s*(\d+)\s*│", r.stdout)
        # n % 49 == 0 fails every attempt (4 jobs); other n % 7 == 0 fail once (24 jobs).
        assert sorted((s, int(a), int(n)) for s, a, n in rows) == [
            ("done", 1, 172), ("done", 2, 24), ("failed", 3, 4)], r.stdout
        assert re.search(r"196 done, 4 failed", r.stdout), r.stdout
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier("asyncjobq_demo")))
