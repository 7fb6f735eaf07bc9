"""The zero-set-up default: a pgserver PostgreSQL under ./.asyncjobq/ (or $ASYNCJOBQ_HOME).

pgserver keeps a list of the processes using a data directory behind a file lock, so two
processes asking at once share one server, and the last one to exit stops it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ..errors import EmbeddedUnavailableError

HOME_ENV = "ASYNCJOBQ_HOME"
_server: Any = None


def embedded_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or ".asyncjobq").resolve()


def start_pgserver(pgdata: Path, cleanup_mode: str | None = "stop") -> Any:
    """Start (or attach to) the pgserver PostgreSQL in `pgdata`.

    pgserver gives `pg_ctl -w start` 10 s; on a loaded 2-core machine it has been seen to time
    out although the server came up. Attaching again then finds the running postmaster.
    """
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers): harmless.
        warnings.simplefilter("ignore")
        import pgserver
        from pgserver.postgres_server import PostgresServer

    pgdata.mkdir(parents=True, exist_ok=True)
    _ensure_system_user()
    for attempt in range(3):
        try:
            return pgserver.get_server(pgdata, cleanup_mode=cleanup_mode)  # type: ignore[attr-defined]
        except subprocess.TimeoutExpired:
            # pgserver registered the half-started handle; drop it so the retry attaches anew.
            PostgresServer._instances.pop(pgdata.resolve(), None)
            PostgresServer._instances.pop(pgdata, None)
            if attempt == 2:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _ensure_system_user() -> None:
    """As root, pgserver runs PostgreSQL as a system user it adds with `useradd` on first
    use. Processes starting servers at once on a fresh machine (test workers, two workers)
    each ran useradd, and an initdb then failed ("could not look up effective user ID"): the
    first creates it under a file lock, the others find it."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    import fcntl
    import pwd

    from pgserver.utils import ensure_user_exists

    try:
        pwd.getpwnam("pgserver")
        return
    except KeyError:
        pass
    lock = Path(tempfile.gettempdir()) / "asyncjobq-pgserver-user.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            ensure_user_exists("pgserver")
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def embedded_dsn(*, notice: bool = True) -> str:
    global _server
    if _server is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import pgserver  # noqa: F401
        except ImportError:
            raise EmbeddedUnavailableError(
                "no database given and the embedded PostgreSQL is not installed: "
                "pip install 'asyncjobq[embedded]', or pass --dsn / set $ASYNCJOBQ_DSN "
                "(e.g. postgresql://postgres@127.0.0.1:5432/postgres)"
            ) from None
        pgdata = embedded_home() / "pgdata"
        try:
            _server = start_pgserver(pgdata)
        except Exception as e:
            raise EmbeddedUnavailableError(
                f"the embedded PostgreSQL in {pgdata} did not start ({type(e).__name__}: {e}); "
                f"see {pgdata / 'log'}, or pass --dsn / set $ASYNCJOBQ_DSN to use another server"
            ) from None
        if notice:
            print(
                f"asyncjobq: no --dsn or $ASYNCJOBQ_DSN given; using embedded PostgreSQL in "
                f"{pgdata} (set $ASYNCJOBQ_DSN to use your own server)",
                file=sys.stderr,
            )
    return str(_server.get_uri())
