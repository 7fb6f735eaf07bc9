"""The PostgreSQL of a test session, shared by tests/ and docs/.

$ASYNCJOBQ_TEST_DSN, else an embedded PostgreSQL 16 started for the session. Under
pytest-xdist (`make test` runs the suite in parallel) each worker process has a server of its
own: an embedded one each, or, on $ASYNCJOBQ_TEST_DSN's server, a database of its own, created
for the session and dropped after it. A test that ends other sessions, counts them or waits on
their locks looks only at its own database (`datname = current_database()`), so tests running
at once in other workers are not touched. What acts on a whole server (restarts, ALTER SYSTEM,
every connection slot taken) runs on a private server of its own (tests/conftest.py,
private_server).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

# Embedded servers' data directories, outside pytest's temporary tree: pgserver opens the path
# to its own system user (o+rx on every parent), and any pytest started meanwhile (tests start
# some) takes those bits off /tmp/pytest-of-<user> again; an initdb then failed, Permission
# denied, under load.
_SERVERS = Path(tempfile.mkdtemp(prefix="asyncjobq-test-pg-"))


def start_embedded(name: str) -> Any:
    from asyncjobq._db.embedded import start_pgserver

    return start_pgserver(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_SERVERS)) / "data",
                          cleanup_mode="delete")


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(_SERVERS, ignore_errors=True)


SERVER_FIXTURES = ("pg_dsn", "asyncjobq_dsn")
GROUPS_ENV = "ASYNCJOBQ_TEST_GROUPS"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None and config.getoption("dist", "no") != "no":
        # The controller schedules; its workers (started after this) say which tests share a
        # group (pytest_collection_modifyitems), in this directory.
        os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="asyncjobq-groups-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None and GROUPS_ENV in os.environ:
        shutil.rmtree(os.environ.pop(GROUPS_ENV), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tiers (pyproject.toml, markers): `unit` needs no database, `processes` starts
    processes or a server of its own, the rest runs in-process on the session's server, which
    is what a second server version must pass (.ci/run)."""
    shared_server = bool(os.environ.get("ASYNCJOBQ_TEST_DSN"))
    groups: dict[str, str] = {}
    for item in items:
        if item.path.suffix == ".md":
            continue  # docs/ pages: a group each (pytest_xdist_make_scheduler)
        names = getattr(item, "fixturenames", ())
        if "private_server" in names:
            item.add_marker(pytest.mark.processes)
        processes = item.get_closest_marker("processes") is not None
        if not processes and not any(f in names for f in SERVER_FIXTURES):
            item.add_marker(pytest.mark.unit)
        if processes and shared_server:
            # A few worker processes hold tens of connections: one such test at a time on a
            # shared server, or max_connections (100 by default) runs out.
            groups[item.nodeid] = "processes"
        elif item.get_closest_marker("drill") is not None:
            # The deployment drills (tests/test_deploy.py) each run servers, a pooler and
            # workers of their own at full speed: one at a time, beside the rest.
            groups[item.nodeid] = "drills"
    folder, worker = os.environ.get(GROUPS_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if folder and worker:
        path = Path(folder) / worker
        path.with_suffix(".tmp").write_text(json.dumps(groups))
        path.with_suffix(".tmp").replace(path)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    dsn = os.environ.get("ASYNCJOBQ_TEST_DSN")
    if not dsn:
        server = start_embedded("session")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        yield dsn
        return
    # The process id keeps two runs on one server (a developer's and CI's) apart.
    # (Not "asyncjobq_...": tests/test_security.py finds no "asyncjobq" in the roles' SQL.)
    name = f"pytest_{worker}_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@pytest.fixture(scope="session")
def asyncjobq_dsn(pg_dsn: str) -> str:
    """The plugin's session server (asyncjobq.pytest_plugin) is this suite's own."""
    return pg_dsn


@pytest.fixture
def private_server() -> Iterator[Any]:
    """A PostgreSQL of the test's own, so that the test may restart it, change its settings or
    take all of its connection slots."""
    server = start_embedded("private")
    yield server
    server.cleanup()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    # A test's captured output may hold a lone surrogate (tests/test_worker.py logs one on
    # purpose); pytest-xdist sends reports as UTF-8 and its worker would crash on it.
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [(title, text.encode("utf-8", "backslashreplace").decode())
                       for title, text in report.sections]


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """--dist loadgroup with groups of this suite's own (pytest-xdist 3.8 reads its
        xdist_group mark into a node id that pytest 9.2 no longer uses): each page of docs/
        (a page's blocks share one namespace, in order: docs/conftest.py), and on a shared
        server the `processes` tier."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        folder = Path(os.environ[GROUPS_ENV])
        known: dict[str, str] = {}

        class Groups(LoadGroupScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                if path.endswith(".md"):
                    return path
                if not known:  # every worker collected before the first schedule
                    for f in folder.iterdir():
                        known.update(json.loads(f.read_text()))
                    known.setdefault("", "")
                return known.get(nodeid, nodeid)

        return Groups(config, log)
