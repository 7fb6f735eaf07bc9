"""Every code block of the documentation runs, against a real PostgreSQL.

- ```python blocks (and `% invisible-code-block: python` comments, which hold a page's checks)
  run in order, one namespace per page, as statements of an async function: top-level `await`
  works, as in `python -m asyncio`. A page creates its `queue = asyncjobq.Queue()` and then
  calls `await isolate(queue)` in an invisible block: that binds the queue to a fresh schema of
  the test server (asyncjobq.testing.isolated), dropped when the page ends. A page that opens a
  queue without isolating it fails: $ASYNCJOBQ_DSN points nowhere while pages run.
- ```console blocks: every `$ python -m asyncjobq ...` line is parsed by the real CLI (command,
  options, their types), so a renamed option fails here. Getting started's commands are also
  run for real (tests/test_docs.py).

Blocks meant as listings only are fenced as ```pyi or ```text; tests/test_docs.py refuses a
```py or ```python3 block, which would look tested without being run.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import shlex
import uuid
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import click
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sybil import Example, Sybil
from sybil.evaluators.python import pad
from sybil.parsers.myst import CodeBlockParser

from asyncjobq.cli import main as cli
from asyncjobq.testing import isolated

# Pages may only reach the test server through isolate(): any other DSN is refused.
UNREACHABLE = "postgresql://docs-page-without-isolate@127.0.0.1:9/none?connect_timeout=1"


def run_python(example: Example) -> None:
    ns = example.namespace
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    code = compile(source, example.path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
                   dont_inherit=True)
    try:
        result = eval(code, ns)
        if inspect.iscoroutine(result):
            ns["__runner__"].run(result)
    finally:
        ns.pop("__builtins__", None)


def cli_args(line: str) -> list[str] | None:
    """The CLI's arguments of a `$ python -m asyncjobq ...` line, or None for another command."""
    words = shlex.split(line, comments=True)
    if words[:3] == ["python", "-m", "asyncjobq"]:
        return words[3:]
    if words[:1] == ["asyncjobq"]:
        return words[1:]
    return None


def check_console(example: Example) -> None:
    """Each asyncjobq command line of the block parses: command, options and their values."""
    for line in str(example.parsed).splitlines():
        if not line.startswith("$ "):
            continue
        args = cli_args(line[2:])
        if args is None:
            continue
        try:
            with cli.make_context("asyncjobq", args[:1]) as ctx:
                command = cli.get_command(ctx, args[0]) if args else None
                if command is None:
                    raise click.UsageError(f"no such command: {args[:1]}")
                command.make_context(args[0], args[1:], parent=ctx)
        except click.ClickException as e:
            raise AssertionError(
                f"{example.path}:{example.line}: {line!r}: {e.format_message()}") from None


def setup(ns: dict[str, Any]) -> None:
    ns["__name__"] = "app"  # tasks a page defines are named app.<function>, as in an app.py
    ns["__runner__"] = asyncio.Runner()
    ns["__exits__"] = []
    ns["__dsn_env__"] = os.environ.get("ASYNCJOBQ_DSN")
    os.environ["ASYNCJOBQ_DSN"] = UNREACHABLE

    async def isolate(queue: Any) -> None:
        block: AbstractAsyncContextManager[Any] = isolated(queue, dsn=ns["asyncjobq_dsn"])
        await block.__aenter__()
        ns["__exits__"].append(block)

    ns["isolate"] = isolate


def teardown(ns: dict[str, Any]) -> None:
    """Every exit runs, in reverse, even when one raises (the first error is raised after): a
    failed page must not leave a worker, a pool or a global behind for the pages after it."""
    runner: asyncio.Runner = ns["__runner__"]
    errors: list[BaseException] = []
    for block in reversed(ns["__exits__"]):
        try:
            runner.run(block.__aexit__(None, None, None))
        except Exception as e:
            errors.append(e)
    runner.close()  # cancels whatever a failed page left running
    if ns["__dsn_env__"] is None:
        os.environ.pop("ASYNCJOBQ_DSN", None)
    else:
        os.environ["ASYNCJOBQ_DSN"] = ns["__dsn_env__"]
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def asyncjobq_dsn(asyncjobq_dsn: str) -> Iterator[str]:
    """The pages' own database on the session's server (the plugin's `asyncjobq_dsn`).

    Vacuum's horizon is kept per database: a transaction another test (or another user of a
    shared server) leaves open elsewhere cannot stop the vacuum the pages show, nor appear in
    the doctor's findings they assert on."""
    name = f"asyncjobq_docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(asyncjobq_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(asyncjobq_dsn, dbname=name)
    finally:
        with psycopg.connect(asyncjobq_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


pytest_collect_file = Sybil(
    parsers=[CodeBlockParser("python", run_python), CodeBlockParser("console", check_console)],
    patterns=["*.md"],
    setup=setup,
    teardown=teardown,
    fixtures=["asyncjobq_dsn"],
    name="docs",
).pytest()
