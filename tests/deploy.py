"""The real parts of the deployment drills (tests/test_deploy.py): PostgreSQL clusters of the
test's own (a primary, a streaming standby made by pg_basebackup), PgBouncer in front of one,
and a network namespace joined to the host by a veth pair.

Each part is started from the machine's own binaries (.ci/run installs Debian's pgbouncer and
iproute2) and removed when its `with` block ends, failed test or not. Where a part cannot run
here (no binary, not root for a namespace) the test skips saying why, except under CI
($CI set), where a missing part fails: the drills must run there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

ROOT = os.geteuid() == 0


def unavailable(why: str) -> None:
    """Skip, or fail under CI ($CI, or $ASYNCJOBQ_DRILLS_REQUIRED that .ci/run sets), where
    every part must be there."""
    if os.environ.get("CI") or os.environ.get("ASYNCJOBQ_DRILLS_REQUIRED"):
        pytest.fail(f"{why} (CI must run this drill: .ci/run installs what it needs)")
    pytest.skip(why)


def pg_bindir() -> Path:
    """The machine's PostgreSQL binaries (Debian's newest), else the embedded server's."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                    key=lambda p: int(p.parent.parent.name))
    if debian:
        return debian[-1].parent
    try:
        import pgserver
    except ImportError:
        unavailable("no PostgreSQL binaries (initdb, pg_ctl, pg_basebackup) on this machine")
        raise
    return Path(pgserver.__file__).parent / "pginstall" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(argv: list[str]) -> list[str]:
    # initdb, postgres and pgbouncer refuse to run as root.
    return ["runuser", "-u", "postgres", "--", *argv] if ROOT else argv


def _run(argv: list[str], timeout: float = 120) -> str:
    done = subprocess.run(_as_postgres(argv), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _workdir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if ROOT:
        shutil.chown(path, "postgres", "postgres")
    return path


class Cluster:
    """A PostgreSQL of the test's own, listening on `addresses` at `port`."""

    def __init__(self, data: Path, port: int, addresses: str = "127.0.0.1") -> None:
        self.data = data
        self.port = port
        self.addresses = addresses
        self.bin = pg_bindir()

    @classmethod
    def create(cls, root: Path, name: str, *, addresses: str = "127.0.0.1",
               settings: dict[str, str] | None = None) -> Cluster:
        cluster = cls(root / name, free_port(), addresses)
        _run([str(cluster.bin / "initdb"), "-D", str(cluster.data), "-U", "postgres",
              "--auth=trust", "-E", "UTF8", "--no-sync"])
        conf = {"port": str(cluster.port), "listen_addresses": f"'{addresses}'",
                "unix_socket_directories": f"'{root}'", "fsync": "off",
                "max_connections": "200", "wal_level": "replica", "max_wal_senders": "5",
                "log_min_messages": "warning", **(settings or {})}
        with (cluster.data / "postgresql.conf").open("a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        with (cluster.data / "pg_hba.conf").open("a") as f:
            # Link-local only: the worker's end of a test's own veth pair.
            f.write("host all all 169.254.0.0/16 trust\n"
                    "host replication all 127.0.0.1/32 trust\n")
        return cluster

    def dsn(self, host: str = "127.0.0.1") -> str:
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    def start(self) -> None:
        _run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60",
              "-l", str(self.data / "server.log"), "start"])

    def stop(self, mode: str = "fast") -> None:
        _run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode,
              "stop"])

    def promote(self) -> None:
        _run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"])

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def standby(self, root: Path, name: str, application_name: str) -> Cluster:
        """A streaming standby of this cluster, from pg_basebackup, not started."""
        standby = Cluster(root / name, free_port(), self.addresses)
        _run([str(self.bin / "pg_basebackup"), "-D", str(standby.data), "-R", "-X", "stream",
              "-d", f"host=127.0.0.1 port={self.port} user=postgres "
                    f"application_name={application_name}"])
        with (standby.data / "postgresql.auto.conf").open("a") as f:
            f.write(f"port = {standby.port}\n")
        return standby

    def log(self) -> str:
        path = self.data / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def clusters() -> Iterator[Path]:
    """A directory for the test's clusters; every server in it is stopped at the end."""
    root = _workdir("asyncjobq-deploy-")
    pg_ctl = pg_bindir() / "pg_ctl"
    try:
        yield root
    finally:
        for pid_file in root.glob("*/postmaster.pid"):
            subprocess.run(_as_postgres([str(pg_ctl), "-D",
                                         str(pid_file.parent), "-m", "immediate", "stop"]),
                           capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(target: Cluster, *, pool_size: int = 8) -> Iterator[str]:
    """PgBouncer in transaction mode in front of `target`; yields its DSN."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        unavailable("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    if ROOT and shutil.which("runuser") is None:
        unavailable("runuser (util-linux) is needed to run pgbouncer as postgres")
    work = _workdir("asyncjobq-pgbouncer-")
    port = free_port()
    (work / "users.txt").write_text('"postgres" ""\n')
    settings = {**documented_pgbouncer_settings(), "default_pool_size": str(pool_size),
                "listen_addr": "127.0.0.1", "listen_port": str(port), "unix_socket_dir": "",
                "auth_type": "trust", "auth_file": str(work / "users.txt"),
                "logfile": str(work / "pgbouncer.log"), "pidfile": str(work / "pgbouncer.pid")}
    (work / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"postgres = host=127.0.0.1 port={target.port} dbname=postgres\n"
        "[pgbouncer]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    if ROOT:
        for f in work.iterdir():
            shutil.chown(f, "postgres", "postgres")
    # -q: it logs to its logfile only (a pipe nobody reads would fill and stop it).
    proc = subprocess.Popen(_as_postgres([binary, "-q", str(work / "pgbouncer.ini")]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("pgbouncer did not start: "
                                       + (work / "pgbouncer.log").read_text()[-2000:]) from None
                time.sleep(0.1)
        yield dsn
    finally:
        # pgbouncer itself, not only runuser in front of it.
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((work / "pgbouncer.pid").read_text()), 15)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def documented_pgbouncer_settings() -> dict[str, str]:
    """The [pgbouncer] settings docs/guides/deploying.md gives: the drill runs with them."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "deploying.md")
    blocks = re.findall(r"```ini\n(.*?)```", page.read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith("[pgbouncer]")]
    pairs = (line.split("=", 1) for line in block.splitlines()[1:]
             if "=" in line and not line.startswith(";"))
    settings = {k.strip(): v.strip() for k, v in pairs}
    assert settings["pool_mode"] == "transaction", settings
    return settings


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespace:
    """A network namespace joined to the host by a veth pair with link-local addresses: the
    host's end is `host_address`, the namespace's `address`. `cut()` takes the link down,
    `mend()` brings it back."""

    def __init__(self) -> None:
        # A name no namespace has now (another run's, or one a killed run left).
        taken = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               timeout=30).stdout if shutil.which("ip") else ""
        tag = next(t for t in range(1, 250) if f"ajq{t} " not in taken + " "
                   and f"ajq{t}\n" not in taken)
        self.name = f"ajq{tag}"
        self.host_if = f"ajqh{tag}"
        self.ns_if = f"ajqn{tag}"
        subnet = 1 + tag % 250
        self.host_address = f"169.254.{subnet}.1"
        self.address = f"169.254.{subnet}.2"

    def __enter__(self) -> Namespace:
        if not ROOT or shutil.which("ip") is None:
            unavailable("a network namespace needs root and iproute2 (ip)")
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            self.exec_ip("addr", "add", f"{self.address}/30", "dev", self.ns_if)
            self.exec_ip("link", "set", self.ns_if, "up")
            self.exec_ip("link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def exec_ip(self, *args: str) -> None:
        _ip("netns", "exec", self.name, "ip", *args)

    def prefix(self) -> list[str]:
        """What runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def mend(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def report(drill: str, **figures: object) -> None:
    """The drill's figures: printed (pytest -s shows them), and one JSON line appended to
    $ASYNCJOBQ_DRILL_REPORT when it is set."""
    import json

    line = json.dumps({"drill": drill, **figures})
    print(line)
    path = os.environ.get("ASYNCJOBQ_DRILL_REPORT")
    if path:
        with Path(path).open("a") as f:
            f.write(line + "\n")


class Events:
    """The lines the drill app's handlers wrote to $DEPLOY_LOG (tests/apps/deployapp.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read = 0  # bytes parsed so far: each read parses only what was added
        self._events: list[tuple[str, str, int, int, int, float]] = []

    def read(self) -> list[tuple[str, str, int, int, int, float]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._read)
            added = f.read()
        complete = added[:added.rfind(b"\n") + 1]  # a line being written waits
        self._read += len(complete)
        for line in complete.decode().splitlines():
            event, task, job, attempt, pid, at = line.split()
            self._events.append((event, task, int(job), int(attempt), int(pid), float(at)))
        return self._events  # not to be changed by callers

    def of(self, event: str,
           task: str | None = None) -> list[tuple[str, str, int, int, int, float]]:
        return [e for e in self.read() if e[0] == event and (task is None or e[1] == task)]
