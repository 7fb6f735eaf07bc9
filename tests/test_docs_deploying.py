"""docs/guides/deploying.md's systemd unit, Dockerfile and Kubernetes manifests are real.

Every asyncjobq command in them (ExecStart=, CMD, a container's command: and args:, and the
`docker run ... python -m asyncjobq ...` lines) is parsed by the CLI's own click definitions,
as docs/conftest.py parses console blocks: a renamed option or a bad value fails here. Each
supervisor's stop timeout (TimeoutStopSec, terminationGracePeriodSeconds, docker's
--stop-timeout) must outlast what the page says a worker's shutdown can take, 2 x
--shutdown-timeout + 40 s, and each health check must reach the --metrics-port the worker
opens. The YAML is parsed with PyYAML when it is installed (the docs extra brings it); without
it the same values are read from the text, which the page writes in JSON-style flow lists.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from asyncjobq.cli import main as cli

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "deploying.md"
# The bounded waits of a shutdown after --shutdown-timeout (worker.py, _fetch_then_shutdown):
# cancelled handlers 5 s, last outcomes 10 s, hooks 5 s, a lost claim's release 10 s; a flush
# in flight at the signal may take another shutdown_timeout; then the CLI's queue.close()
# waits up to hooks.timeout (10 s) for hooks still running.
AFTER_SHUTDOWN_TIMEOUT = 40.0

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```",
                    re.M | re.S)


def blocks(lang: str) -> list[str]:
    text = PAGE.read_text()
    found = [m.group("body") for m in _FENCE.finditer(text) if m.group("lang") == lang]
    assert found, f"{PAGE.name} has no ```{lang} block"
    return found


def parse(args: list[str]) -> dict[str, Any]:
    """The command's parameters as the real CLI parses them (no command runs)."""
    if not args:
        raise click.UsageError("no asyncjobq command")
    with cli.make_context("asyncjobq", args[:1]) as ctx:
        command = cli.get_command(ctx, args[0])
        if command is None:
            raise click.UsageError(f"no such command: {args[0]!r}")
        with command.make_context(args[0], args[1:], parent=ctx) as sub:
            return dict(sub.params)


def asyncjobq_args(words: list[str]) -> list[str] | None:
    """The CLI's arguments in a command line (`... python -m asyncjobq ARGS` or
    `asyncjobq ARGS`), or None when it runs something else."""
    for i in range(len(words)):
        if words[i:i + 2] == ["-m", "asyncjobq"]:
            return words[i + 2:]
        if words[i] == "asyncjobq" or words[i].endswith("/bin/asyncjobq"):
            return words[i + 1:]
    return None


@dataclass
class Worker:
    where: str
    params: dict[str, Any]

    @property
    def shutdown_bound(self) -> float:
        """What the page says a worker's stop can take at most."""
        return 2 * float(self.params["shutdown_timeout"]) + AFTER_SHUTDOWN_TIMEOUT


def checked(where: str, words: list[str]) -> tuple[str, dict[str, Any]]:
    args = asyncjobq_args(words)
    assert args is not None, f"{where}: not an asyncjobq command: {words}"
    try:
        return args[0], parse(args)
    except click.ClickException as e:
        raise AssertionError(f"{where}: {shlex.join(args)}: {e.format_message()}") from None


def test_the_check_refuses_what_the_cli_refuses() -> None:
    """The parse is the CLI's: a misspelt option, a bad value, an unknown command fail."""
    assert parse(["worker", "app:queue", "--concurrency", "5"])["concurrency"] == 5
    for bad in (["worker", "app:queue", "--concurency", "5"],
                ["worker", "app:queue", "--shutdown-timeout", "soon"],
                ["worker", "app"], ["wroker", "app:queue"], ["install", "--schema", "a b"]):
        with pytest.raises(click.UsageError):
            parse(bad)


# --- systemd -----------------------------------------------------------------------------------

def systemd_seconds(value: str) -> float:
    """A systemd time span: `95`, `95s`, `1min 35s`, `2m`."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(min|sec|s|m|h|)\s*", value.strip())
    assert parts and "".join(n + u for n, u in parts) == value.replace(" ", ""), value
    return sum(float(n) * units[u] for n, u in parts)


def test_the_systemd_unit() -> None:
    (unit,) = [b for b in blocks("ini") if "[Unit]" in b]
    settings: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    assert settings.get("Restart") == ["on-failure"], settings
    (exec_start,) = settings["ExecStart"]
    # %i, the template's instance, as `systemctl start asyncjobq-worker@1` gives it.
    words = shlex.split(exec_start.replace("%i", "1").replace("%%", "%"))
    assert words[0].startswith("/"), "systemd needs an absolute ExecStart path"
    command, params = checked("ExecStart", words)
    assert command == "worker"
    assert params["metrics_port"] == 9461
    worker = Worker("systemd", params)
    (stop,) = settings["TimeoutStopSec"]
    assert systemd_seconds(stop) > worker.shutdown_bound, (stop, worker.shutdown_bound)
    # A usage mistake exits 2: the unit must not restart it in a loop.
    assert settings["RestartPreventExitStatus"] == ["2"]


# --- Docker --------------------------------------------------------------------------------------

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_the_dockerfile_and_its_docker_commands() -> None:
    (dockerfile,) = blocks("dockerfile")
    instructions = dockerfile_instructions(dockerfile)
    cmds = [rest for name, rest in instructions if name == "CMD"]
    assert len(cmds) == 1, cmds
    # Exec form (a JSON array): python is PID 1 and receives SIGTERM itself.
    words = json.loads(cmds[0])
    assert isinstance(words, list) and words[0] == "python", words
    command, params = checked("CMD", words)
    assert command == "worker"
    worker = Worker("docker", params)
    port = params["metrics_port"]
    assert ("EXPOSE", str(port)) in instructions
    (health,) = [rest for name, rest in instructions if name == "HEALTHCHECK"]
    probe = json.loads(health.split("CMD", 1)[1])
    assert f"http://127.0.0.1:{port}/metrics" in " ".join(probe), probe

    # The page's docker run lines: their asyncjobq commands parse, and the stop timeout of the
    # one that runs the image's worker outlasts its shutdown.
    stop_timeouts = []
    for block in blocks("console"):
        for line in block.splitlines():
            line = line.strip()
            if not line.startswith("$ docker run"):
                continue
            words = shlex.split(line[2:])
            if asyncjobq_args(words) is not None:
                checked(line, words)
            elif "--stop-timeout" in words:
                stop_timeouts.append(float(words[words.index("--stop-timeout") + 1]))
    assert stop_timeouts, "no `docker run --stop-timeout` line for the worker"
    assert all(t > worker.shutdown_bound for t in stop_timeouts), stop_timeouts


# --- Kubernetes ----------------------------------------------------------------------------------

_FLOW = re.compile(r"^(?P<indent> *)(?:- )?(?P<key>command|args): (?P<value>\[.*\])\s*$", re.M)


def containers_from_text(text: str) -> list[list[str]]:
    """Each container's command + args, from the text: JSON-style flow lists, args (if any)
    right after its command, as the page writes them."""
    found: list[list[str]] = []
    for m in _FLOW.finditer(text):
        value = json.loads(m.group("value"))
        if m.group("key") == "command":
            found.append(value)
        else:
            assert found, "args: before any command:"
            found[-1] = found[-1] + value
    return found


def containers_from_yaml(text: str) -> list[list[str]] | None:
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        return None
    found = []
    for doc in yaml.safe_load_all(text):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            found.append([*container.get("command", []), *container.get("args", [])])
    return found


def test_the_kubernetes_manifests() -> None:
    (manifests,) = blocks("yaml")
    containers = containers_from_text(manifests)
    parsed = containers_from_yaml(manifests)
    if parsed is not None:  # the text read agrees with a YAML parser's
        assert parsed == containers, (parsed, containers)
    commands = {}
    for words in containers:
        command, params = checked("container", words)
        commands[command] = params
    assert set(commands) == {"install", "worker"}, commands
    worker = Worker("kubernetes", commands["worker"])
    (grace,) = re.findall(r"terminationGracePeriodSeconds: (\d+)", manifests)
    assert int(grace) > worker.shutdown_bound, (grace, worker.shutdown_bound)
    (port,) = re.findall(r"containerPort: (\d+)", manifests)
    assert int(port) == worker.params["metrics_port"]
    assert re.search(r"readinessProbe:\s*\n\s*httpGet: \{path: /metrics, port: metrics\}",
                     manifests)
    if parsed is not None:
        import yaml  # type: ignore[import-untyped, unused-ignore]

        job, deployment = yaml.safe_load_all(manifests)
        assert (job["kind"], deployment["kind"]) == ("Job", "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == int(grace)
        (container,) = pod["containers"]
        assert container["ports"] == [{"name": "metrics", "containerPort": int(port)}]
        assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert deployment["spec"]["template"]["metadata"]["labels"] == selector
