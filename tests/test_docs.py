"""The documentation site's own checks (docs/conftest.py runs the pages' code blocks):

- every fenced block names a language the build highlights, and none looks like Python that
  would not run (```py, ```python3: only ```python blocks are executed);
- every `literalinclude` shows a file under examples/, and every example file is shown in the
  README or the docs (tests/test_readme.py and the tests it names run each one);
- Getting started, followed as a newcomer would, command by command: `make demo`, a worker and
  an enqueue from the shell, then each web example served by uvicorn with its worker, an order
  posted with curl and the job seen run, on an embedded PostgreSQL of its own (no DSN, as on a
  fresh clone).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT
from test_readme import EXAMPLES, Block, fenced_blocks

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# What a block may be fenced as: ```python runs (docs/conftest.py), ```console is parsed by the
# CLI, the rest are listings the build highlights. ```{...} are MyST directives.
LANGUAGES = {"python", "console", "pyi", "text", "sql", "yaml", "ini", "dockerfile", "json",
             "promql", "toml"}
GETTING_STARTED = DOCS / "getting-started.md"


def page_id(path: Path) -> str:
    return str(path.relative_to(DOCS))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_run_or_a_named_listing(page: Path) -> None:
    problems = []
    for block in fenced_blocks(page.read_text()):
        if block.lang.startswith("{"):
            continue
        if block.lang not in LANGUAGES:
            problems.append(
                f"{page_id(page)} line {block.line}: a ```{block.lang or '(no language)'} block: "
                "fence code to run as ```python (executed by the suite), a listing as ```pyi or "
                f"```text, or use one of {sorted(LANGUAGES)}")
    assert not problems, "\n".join(problems)


def literal_includes(page: Path) -> list[Path]:
    return [(page.parent / b.lang_args).resolve() for b in directive_blocks(page, "literalinclude")]


@dataclass
class Directive:
    line: int
    lang_args: str


def directive_blocks(page: Path, name: str) -> list[Directive]:
    pattern = re.compile(rf"^ {{0,3}}(`{{3,}}|~{{3,}})\{{{name}\}}\s*(\S+)", re.M)
    text = page.read_text()
    return [Directive(text[:m.start()].count("\n") + 1, m.group(2)) for m in pattern.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_literal_includes_show_example_files(page: Path) -> None:
    for path in literal_includes(page):
        assert path.is_file(), f"{page_id(page)} includes {path}, which does not exist"
        assert path.is_relative_to(EXAMPLES), (
            f"{page_id(page)} includes {path}: show only files under examples/, which the "
            "suite runs (tests/test_readme.py names where)")


def test_every_example_file_is_shown_in_the_readme_or_the_docs() -> None:
    shown = {p for page in PAGES for p in literal_includes(page)}
    readme = (ROOT / "README.md").read_text()
    readme_blocks = {b.text.strip() for b in fenced_blocks(readme) if b.lang == "python"}
    for path in sorted(EXAMPLES.glob("*.py")):
        assert path in shown or path.read_text().strip() in readme_blocks, (
            f"examples/{path.name} is neither included in a docs page nor shown in README.md")


# --- Getting started, followed as a newcomer would -------------------------------------------

@dataclass
class Command:
    line: str
    output: list[str] = field(default_factory=list)

    @property
    def background(self) -> bool:
        return self.line.rstrip().endswith("# leave it running")


@dataclass
class Section:
    title: str
    commands: list[Command] = field(default_factory=list)
    worker_prints: list[str] = field(default_factory=list)


def sections(markdown: str) -> list[Section]:
    """Getting started's `## ` sections, each with its shell commands (and the output the page
    shows for them) and the lines the page says the worker prints."""
    found: list[Section] = []
    lines = markdown.splitlines()
    blocks = {b.line: b for b in fenced_blocks(markdown)}
    for number, text in enumerate(lines, start=1):
        if text.startswith("## "):
            found.append(Section(text[3:].strip()))
        block: Block | None = blocks.get(number)
        if block is None or not found:
            continue
        if block.lang == "console":
            for line in block.text.splitlines():
                if line.startswith("$ "):
                    found[-1].commands.append(Command(line[2:]))
                elif line.strip() and found[-1].commands:
                    found[-1].commands[-1].output.append(line.strip())
        elif block.lang == "text" and "worker prints" in " ".join(lines[max(0, number - 4):number]):
            found[-1].worker_prints.extend(x for x in block.text.splitlines() if x.strip())
    return found


# Commands the walk-through does not run: the suite itself, and the activation it stands in for
# by putting the virtualenv first on PATH.
NOT_RUN = {"make test", ". .venv/bin/activate"}
# A background command is ready when its output shows this.
READY = {"uvicorn": "Application startup complete", "python": " started: queues="}
WALKED = ["The two commands", "Your first job", "Enqueue from a web request, in its transaction",
          "The same with FastAPI"]


def newcomer_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"ASYNCJOBQ_DSN", "ASYNCJOBQ_TEST_DSN", "QUEUE_SCHEMA", "PYTHONPATH"}}
    venv_bin = str(Path(sys.executable).parent)
    env.update(ASYNCJOBQ_HOME=str(home), PATH=f"{venv_bin}:{env.get('PATH', '')}",
               VIRTUAL_ENV=str(Path(venv_bin).parent))
    return env


def wait_until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_free_ports(commands: list[Command]) -> list[str]:
    """The section's command lines with each port the page serves on (`--port N`, then
    `localhost:N`) moved to a free one: the suite itself, or anything else on this machine,
    may hold 8000 while the walk-through runs."""
    ports = {m.group(1) for c in commands for m in re.finditer(r"--port (\d+)", c.line)}
    lines = []
    for command in commands:
        line = command.line
        for port in ports:
            line = re.sub(rf"(--port |localhost:){port}\b", rf"\g<1>{PORTS[port]}", line)
        lines.append(line)
    return lines


PORTS: dict[str, int] = {}


def run(line: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """A one-shot command, its whole process group killed if it outlives `timeout` (`make demo`
    starts workers and an embedded server)."""
    proc = subprocess.Popen(["bash", "-c", line], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{line!r} ran longer than {timeout} s:\n{out.decode()}"
                             f"\n{err.decode()}") from None
    return proc.returncode, out.decode(), err.decode()


def test_the_getting_started_sections_are_the_ones_walked() -> None:
    titles = [s.title for s in sections(GETTING_STARTED.read_text())]
    assert set(WALKED) <= set(titles), titles
    for section in sections(GETTING_STARTED.read_text()):
        if section.title in WALKED:
            assert section.commands, f"no command in {section.title!r}"


@pytest.mark.timeout(420)
@pytest.mark.processes
def test_a_newcomer_follows_getting_started_from_a_fresh_clone(tmp_path: Path) -> None:
    env = newcomer_env(tmp_path / "home")
    for section in sections(GETTING_STARTED.read_text()):
        if section.title not in WALKED:
            continue
        background: list[tuple[Command, subprocess.Popen[bytes], Path]] = []
        for port in re.findall(r"--port (\d+)", " ".join(c.line for c in section.commands)):
            PORTS[port] = free_port()
        try:
            for n, (command, line) in enumerate(zip(section.commands,
                                                    on_free_ports(section.commands),
                                                    strict=True)):
                line = line.split("#")[0].strip() if command.background else line
                if line in NOT_RUN:
                    continue
                where = f"{section.title!r}, command {line!r}"
                if command.background:
                    program = shlex.split(line)[0]
                    log = tmp_path / f"{section.title[:20]}-{n}.log".replace(" ", "_")
                    with log.open("wb") as out:
                        proc = subprocess.Popen(["bash", "-c", line], cwd=ROOT, env=env,
                                                stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True)
                    background.append((command, proc, log))
                    ready = READY[program]
                    wait_until(lambda: ready in log.read_text() or proc.poll() is not None,  # noqa: B023
                               60, f"{where} to be ready")
                    assert proc.poll() is None, f"{where} exited: {log.read_text()}"
                    continue
                code, out, err = run(line, env, timeout=240)
                assert code == 0, f"{where} failed:\n{out}\n{err}"
                for expected in command.output:
                    assert expected in out.splitlines(), (
                        f"{where}: the page shows {expected!r}, the command printed:\n{out}")
            workers = [(c, p, log) for c, p, log in background if "asyncjobq worker" in c.line]
            for expected in section.worker_prints:
                assert workers, f"{section.title!r} shows what a worker prints, but runs none"
                log = workers[-1][2]
                wait_until(lambda: expected in log.read_text().splitlines(), 60,  # noqa: B023
                           f"{section.title!r}: the worker to print {expected!r}")
        finally:
            for _, proc, _ in background:  # Ctrl-C, as the page says
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
            codes = []
            for command, proc, log in background:
                try:
                    codes.append((command.line, proc.wait(timeout=60), log))
                except subprocess.TimeoutExpired:  # the others are still stopped and waited for
                    os.killpg(proc.pid, signal.SIGKILL)
                    codes.append((command.line, proc.wait(), log))
        for line, code, log in codes:
            text = log.read_text()
            assert code == 0, f"{line!r} exited {code} after Ctrl-C:\n{text}"
            assert "Traceback" not in text, f"{line!r} printed a traceback:\n{text}"
            assert "INFO pgserver" not in text, f"{line!r} narrated pgserver's start:\n{text}"


def test_the_readme_commands_are_walked_in_getting_started() -> None:
    """The README's shell lines are Getting started's (and so run by the walk-through above)."""
    walked = {c.line.split("#")[0].strip() for s in sections(GETTING_STARTED.read_text())
              for c in s.commands}
    readme = (ROOT / "README.md").read_text()
    lines = [line.split("#")[0].strip() for b in fenced_blocks(readme) if b.lang == ""
             for line in b.text.splitlines() if line.strip()]
    assert lines, "README.md shows no commands: is the parser broken?"
    missing = [line for line in lines if line not in walked]
    assert not missing, f"README.md commands that Getting started does not run: {missing}"
