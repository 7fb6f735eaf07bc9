"""The zero-set-up default: a pgserver PostgreSQL under ./.asyncjobq/ (or $ASYNCJOBQ_HOME).

pgserver keeps a list of the processes using a data directory behind a file lock, so two
processes asking at once share one server, and the last one to exit stops it.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from .errors import EmbeddedUnavailableError

HOME_ENV = "ASYNCJOBQ_HOME"
_server: Any = None


def embedded_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or ".asyncjobq").resolve()


def embedded_dsn(*, notice: bool = True) -> str:
    global _server
    if _server is None:
        try:
            with warnings.catch_warnings():
                # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers): harmless.
                warnings.simplefilter("ignore")
                import pgserver
        except ImportError:
            raise EmbeddedUnavailableError(
                "no database given and the embedded PostgreSQL is not installed: "
                "pip install 'asyncjobq[embedded]', or pass --dsn / set $ASYNCJOBQ_DSN "
                "(e.g. postgresql://postgres@127.0.0.1:5432/postgres)"
            ) from None
        pgdata = embedded_home() / "pgdata"
        try:
            pgdata.mkdir(parents=True, exist_ok=True)
            _server = pgserver.get_server(  # type: ignore[attr-defined]
                pgdata, cleanup_mode="stop")
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
