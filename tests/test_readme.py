"""README.md's Python runs: every ```python block in it is a file under examples/, shown verbatim
(the docs include the others: tests/test_docs.py), and each example app is served here for
real: its lifespan opens the queue, a POST writes an order and its job in one transaction (a
rolled-back order leaves no job), and a worker runs the job, in this process and as the
example's docstring says to start one.

Blocks that are not meant to run (the API's signature listing) are fenced as ```pyi or ```text.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager
from conftest import ROOT, running, wait_for
from psycopg.conninfo import make_conninfo

from asyncjobq import Queue, Worker

README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
# Info strings that mark a block as Python to run; ```pyi, ```text and the rest are not.
PYTHON = {"python", "python3", "py", "py3"}
APPS = ["starlette_app", "fastapi_app"]


# --- the README shows the files ------------------------------------------------------------

@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")


def fenced_blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of a CommonMark text, with their opening line and language."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        body: list[str] = []
        i += 1
        # Closed by the same character at least as long, or (unclosed) by the end of the text.
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$",
                                              lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append(Block(start + 1, lang, "\n".join(body)))
        i += 1
    return blocks


def python_blocks(markdown: str) -> list[Block]:
    return [b for b in fenced_blocks(markdown) if b.lang in PYTHON]


def example_files() -> dict[str, str]:
    return {f"examples/{p.name}": p.read_text() for p in sorted(EXAMPLES.glob("*.py"))}


def unmatched_blocks(markdown: str, examples: dict[str, str]) -> list[str]:
    """One message per ```python block whose text (stripped) is no example file's text."""
    texts = {text.strip(): path for path, text in examples.items()}
    problems = []
    for block in python_blocks(markdown):
        code = block.text.strip()
        if code in texts:
            continue
        first = code.splitlines()[0] if code else "(empty)"
        msg = (f"README.md line {block.line}: the ```{block.lang} block starting {first!r} is "
               "not the content of any file under examples/: make it one (the README shows "
               "the file verbatim and tests/test_readme.py runs it), or fence it as ```pyi or "
               "```text if it is not meant to run")
        # The nearest file, if any resembles it, with how the two differ.
        ranked = sorted(examples.items(), key=lambda kv: difflib.SequenceMatcher(
            None, code, kv[1].strip()).ratio(), reverse=True)
        if ranked and difflib.SequenceMatcher(None, code, ranked[0][1].strip()).ratio() > 0.5:
            path, text = ranked[0]
            diff = difflib.unified_diff(text.strip().splitlines(), code.splitlines(), path,
                                        f"README.md:{block.line}", lineterm="", n=1)
            msg += "\n" + "\n".join(diff)
        problems.append(msg)
    return problems


def test_every_python_block_in_the_readme_is_an_example_file() -> None:
    markdown = README.read_text()
    assert python_blocks(markdown), "README.md has no ```python block: is the parser broken?"
    problems = unmatched_blocks(markdown, example_files())
    assert not problems, "\n\n".join(problems)


def test_the_readme_shows_the_starlette_example() -> None:
    markdown = README.read_text()
    shown = {b.text.strip() for b in python_blocks(markdown)}
    assert (EXAMPLES / "starlette_app.py").read_text().strip() in shown
    assert "`examples/starlette_app.py`" in markdown


def test_a_python_block_that_is_no_example_is_reported_by_line() -> None:
    markdown = "\n".join([
        "# Title",
        "```python",
        "print('shown')",
        "```",
        "```pyi",
        "def listing(x: int = ...) -> None: ...",
        "```",
        "```",
        "make demo",
        "```",
        "~~~py",
        "app = Starlette(on_startup=[queue.open])",
        "~~~",
        "  ```python",
        "print('shown, but edited')",
        "  ```",
    ])
    examples = {"examples/shown.py": "print('shown')\n"}
    assert [(b.line, b.lang) for b in fenced_blocks(markdown)] == [
        (2, "python"), (5, "pyi"), (8, ""), (11, "py"), (14, "python")]
    problems = unmatched_blocks(markdown, examples)
    assert len(problems) == 2, problems
    assert problems[0].startswith("README.md line 11: the ```py block starting "
                                  "'app = Starlette(on_startup=[queue.open])' is not the "
                                  "content of any file under examples/")
    assert problems[1].startswith("README.md line 14:")
    assert "-print('shown')\n+print('shown, but edited')" in problems[1]


# --- the examples run ----------------------------------------------------------------------

# Refuses, when the transaction commits, an order of 1,000 or more: the order and the job that
# the request enqueued after it are both rolled back.
REFUSE_LARGE_ORDERS_AT_COMMIT = """
CREATE FUNCTION refuse_large_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.total >= 1000 THEN
        RAISE EXCEPTION 'order % refused at commit', NEW.id;
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER refuse_large_order AFTER INSERT ON orders
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_large_order();
"""


@pytest.fixture
def example_env(pg_dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The examples' settings: the test's server, its schema for the queue, and (search_path)
    for the app's own orders table, so that everything is dropped with the schema."""
    env = {"ASYNCJOBQ_DSN": make_conninfo(pg_dsn, options=f"-c search_path={schema}"),
           "QUEUE_SCHEMA": schema}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import examples/<name>.py as `examples.<name>`, the name the worker command uses, afresh
    (the module reads its settings when imported)."""
    spec = importlib.util.spec_from_file_location(f"examples.{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan run (startup before the block, shutdown after), and a client.
    httpx's ASGITransport alone does not run the lifespan."""
    async with LifespanManager(app, startup_timeout=30, shutdown_timeout=60) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://example") as client:
            yield client


async def rows(queue: Queue, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with queue.connection() as conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall()


async def status(queue: Queue, job_id: int) -> str | None:
    info = await queue.get(job_id)
    return None if info is None else info.status


@pytest.mark.parametrize("name", APPS)
async def test_example_app_enqueues_in_the_order_transaction_and_a_worker_runs_the_job(
        name: str, schema: str, example_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    example = load_example(name, monkeypatch)
    queue: Queue = example.queue
    assert queue.schema == schema

    enqueued: list[int] = []

    class Enqueued:
        async def on_enqueued(self, job_ids: list[int], task: str, queue: str) -> None:
            enqueued.extend(job_ids)

    queue.add_hook(Enqueued())

    assert not queue.database.is_open
    async with served(example.app) as client:
        assert queue.database.is_open  # the lifespan opened it
        async with queue.connection() as conn:
            await conn.execute(REFUSE_LARGE_ORDERS_AT_COMMIT)

        # An order that commits: its job exists, queued, about that order.
        r = await client.post("/orders", json={"total": 25})
        assert r.status_code == 200, r.text
        order_id = r.json()["id"]
        await wait_for(lambda: len(enqueued) == 1, timeout=10, what="the order's job enqueued")
        job = await queue.get(enqueued[0])
        assert job is not None
        assert (job.task, job.status, job.payload) == (
            f"examples.{name}.send_receipt", "queued", {"order_id": order_id})

        # An order refused at commit: the job was enqueued in its transaction, and is gone.
        with pytest.raises(psycopg.errors.RaiseException, match="refused at commit"):
            await client.post("/orders", json={"total": 5000})
        await wait_for(lambda: len(enqueued) == 2, timeout=10, what="the refused order's job")
        assert await queue.get(enqueued[1]) is None
        assert await rows(queue, "SELECT id, receipt_sent_at FROM orders") == [(order_id, None)]
        assert await rows(queue, f'SELECT id FROM "{schema}".jobs') == [(enqueued[0],)]

        # A worker runs the job: the order's receipt is noted.
        async def done() -> bool:
            return await status(queue, enqueued[0]) == "done"

        async with running(Worker(queue, poll_interval=0.2, shutdown_timeout=5)):
            await wait_for(done, timeout=30, what="the worker to run the job")
        assert await rows(queue, "SELECT receipt_sent_at IS NOT NULL FROM orders") == [(True,)]

    assert not queue.database.is_open  # the lifespan's shutdown closed it


@pytest.mark.parametrize("name", APPS)
@pytest.mark.processes
async def test_the_worker_command_in_the_example_docstring_runs_its_jobs(
        name: str, example_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    example = load_example(name, monkeypatch)
    queue: Queue = example.queue
    commands = re.findall(r"`(python -m asyncjobq worker [^`]+)`", example.__doc__ or "")
    assert len(commands) == 1, f"examples/{name}.py's docstring names no worker command"
    argv = shlex.split(commands[0])
    assert argv[-1] == f"examples.{name}:queue"

    async with served(example.app) as client:
        r = await client.post("/orders", json={"total": 7})
        assert r.status_code == 200, r.text
        order_id = r.json()["id"]
        # Run from the repository's root, as the docstring's command is meant to be.
        log = tmp_path / "worker.log"
        with log.open("w") as out:
            worker = await asyncio.create_subprocess_exec(
                sys.executable, *argv[1:], "--log-level", "warning", cwd=ROOT,
                env={**os.environ, **example_env}, stdout=out, stderr=subprocess.STDOUT)
        try:
            async def receipt_sent() -> bool:
                assert worker.returncode is None, f"the worker exited: {log.read_text()}"
                found = await rows(queue, "SELECT receipt_sent_at IS NOT NULL FROM orders "
                                          "WHERE id = %s", order_id)
                return found == [(True,)]

            await wait_for(receipt_sent, timeout=30, what="the worker process to run the job")
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.wait_for(worker.wait(), timeout=40)
            except TimeoutError:
                worker.kill()
                await worker.wait()
                raise
        assert code == 0, log.read_text()
