"""The zero-set-up default: no --dsn and no $ASYNCJOBQ_DSN means a pgserver PostgreSQL under
$ASYNCJOBQ_HOME (else ./.asyncjobq), shared by every process that asks, announced on stderr.

These start real embedded servers, so they are few and each has a generous timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS, run_cli, wait_for

import asyncjobq
from asyncjobq._db import embedded

INSTALL_HINT = "pip install 'asyncjobq[embedded]'"


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        return int((pgdata / "postmaster.pid").read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A directory for an embedded server; a server a failed test left running is stopped."""
    yield tmp_path.resolve()
    for pgdata in (tmp_path / "home" / "pgdata", tmp_path / ".asyncjobq" / "pgdata"):
        pid = _postmaster_pid(pgdata)
        if pid is not None and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # fast shutdown of the postmaster our test started


def _env_without_dsn(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(TESTS), **extra)
    env.pop("ASYNCJOBQ_DSN", None)
    return env


def _notice(stderr: str, pgdata: Path) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "embedded PostgreSQL" in lines[0], lines
    assert str(pgdata) in lines[0], lines
    return lines[0]


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_cli_without_dsn_uses_embedded_server(workdir: Path) -> None:
    home = workdir / "home"
    pgdata = home / "pgdata"
    env = {"ASYNCJOBQ_HOME": str(home)}

    r = run_cli("install", env=env, timeout=150)
    assert r.returncode == 0, (r.stdout, r.stderr)
    versions = ", ".join(str(m.version) for m in asyncjobq._db.migrations.available())
    assert r.stdout.strip() == f"schema asyncjobq: applied migrations {versions}", r.stdout
    _notice(r.stderr, pgdata)
    assert (pgdata / "PG_VERSION").exists()

    r = run_cli("enqueue", "t", "--queue", "emb", env=env, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    _notice(r.stderr, pgdata)

    # A third process, a new server start on the same data: the job is still there.
    r = run_cli("status", "--json", env=env, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    _notice(r.stderr, pgdata)
    assert json.loads(r.stdout)["queues"] == {
        "emb": {"queued": 1, "running": 0, "done": 0, "failed": 0, "cancelled": 0}}

    # The last process using the server stopped it on exit.
    assert not (pgdata / "postmaster.pid").exists()


@pytest.mark.processes
def test_dsn_from_environment_wins_over_embedded(pg_dsn: str, schema: str,
                                                 workdir: Path) -> None:
    home = workdir / "home"
    r = run_cli("install", "--schema", schema, dsn=pg_dsn, env={"ASYNCJOBQ_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert "embedded" not in r.stderr, r.stderr
    assert not home.exists()  # no embedded data directory was made


SHARE_SCRIPT = r"""
import pathlib, sys, time
import psycopg
import asyncjobq

me, sync = sys.argv[1], pathlib.Path(sys.argv[2])
dsn = asyncjobq.Queue().dsn

def ask():
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pg_postmaster_start_time()::text, current_setting('data_directory'),"
            " split_part(pg_read_file('postmaster.pid'), E'\n', 1)").fetchone()
    return "|".join(row)

print("first", ask(), flush=True)
(sync / f"ready-{me}").touch()
deadline = time.monotonic() + 120
while not (sync / f"go-{me}").exists():
    if time.monotonic() > deadline:
        sys.exit("never told to go on")
    time.sleep(0.02)
print("again", ask(), flush=True)
"""


def _start_sharer(me: str, cwd: Path, sync: Path) -> subprocess.Popen[str]:
    env = _env_without_dsn()
    env.pop("ASYNCJOBQ_HOME", None)
    return subprocess.Popen([sys.executable, "-c", SHARE_SCRIPT, me, str(sync)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(180)
@pytest.mark.processes
async def test_two_processes_started_at_once_share_one_server(workdir: Path) -> None:
    # No $ASYNCJOBQ_HOME: the data directory is ./.asyncjobq/pgdata of the working directory.
    sync = workdir / "sync"
    sync.mkdir()
    pgdata = workdir / ".asyncjobq" / "pgdata"
    procs = {me: _start_sharer(me, workdir, sync) for me in ("a", "b")}
    try:
        def both_ready() -> bool:
            for me, p in procs.items():
                assert p.poll() is None, (me, p.communicate())
            return all((sync / f"ready-{me}").exists() for me in procs)

        await wait_for(both_ready, timeout=150, interval=0.05, what="both processes connected")

        # a exits while b is alive: the server must keep running for b.
        (sync / "go-a").touch()
        out_a, err_a = procs["a"].communicate(timeout=60)
        assert procs["a"].returncode == 0, err_a
        assert procs["b"].poll() is None
        (sync / "go-b").touch()
        out_b, err_b = procs["b"].communicate(timeout=60)
        assert procs["b"].returncode == 0, err_b
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)

    answers = {}
    for me, out in (("a", out_a), ("b", out_b)):
        lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
        answers[me] = lines
    start_time, data_directory, pid = answers["a"]["first"].split("|")
    assert start_time and pid.isdigit()
    assert Path(data_directory) == pgdata
    assert answers["b"]["first"] == answers["a"]["first"]  # one postmaster, same start
    assert answers["a"]["again"] == answers["a"]["first"]
    assert answers["b"]["again"] == answers["a"]["first"]  # still that server after a left
    for err in (err_a, err_b):
        _notice(err, pgdata)
        assert "Traceback" not in err

    # b was the last user: the server is stopped (pg_ctl -w waited for the pid file to go; the
    # process itself may take a moment longer to be gone).
    assert not (pgdata / "postmaster.pid").exists()
    await wait_for(lambda: not _alive(int(pid)), timeout=30, what=f"postmaster {pid} to exit")


NO_PGSERVER = (
    "import sys; sys.modules['pgserver'] = None\n"  # makes `import pgserver` raise ImportError
    "from asyncjobq.cli import main\n"
    "main(sys.argv[1:], prog_name='asyncjobq')\n"
)


@pytest.mark.parametrize("args", [["install"], ["status", "--json"], ["enqueue", "t"],
                                  ["worker", "apps.testapp:queue"], ["demo", "--jobs", "1"]])
@pytest.mark.processes
def test_without_pgserver_the_cli_says_what_to_do(workdir: Path, args: list[str]) -> None:
    home = workdir / "home"
    r = subprocess.run([sys.executable, "-c", NO_PGSERVER, *args], cwd=TESTS,
                       env=_env_without_dsn(ASYNCJOBQ_HOME=str(home)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("asyncjobq: error: "), lines
    assert INSTALL_HINT in lines[0]
    assert "--dsn" in lines[0] and "$ASYNCJOBQ_DSN" in lines[0]
    assert not home.exists()


def test_without_pgserver_queue_dsn_raises(monkeypatch: pytest.MonkeyPatch,
                                           workdir: Path) -> None:
    monkeypatch.setitem(sys.modules, "pgserver", None)
    monkeypatch.delenv("ASYNCJOBQ_DSN", raising=False)
    monkeypatch.setenv("ASYNCJOBQ_HOME", str(workdir / "home"))
    monkeypatch.setattr(embedded, "_server", None)
    q = asyncjobq.Queue()
    with pytest.raises(asyncjobq.AsyncJobQError) as info:
        _ = q.dsn
    assert isinstance(info.value, asyncjobq.errors.EmbeddedUnavailableError)
    assert INSTALL_HINT in str(info.value)
    assert "--dsn" in str(info.value)
    assert not (workdir / "home").exists()
