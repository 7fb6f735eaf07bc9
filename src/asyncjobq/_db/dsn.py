"""Which PostgreSQL to use (argument > $ASYNCJOBQ_DSN > embedded), and DSNs safe to print."""

from __future__ import annotations

import os
import re

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..errors import ConfigurationError

DSN_ENV = "ASYNCJOBQ_DSN"
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,47}$")


def validate_schema(schema: str) -> str:
    # Lower-case and short: the schema also names the NOTIFY channel "<schema>_jobs", which
    # PostgreSQL limits to 63 bytes, and unquoted-looking names avoid case-folding surprises.
    if not isinstance(schema, str) or not _SCHEMA_RE.match(schema):
        raise ConfigurationError(
            f"schema {schema!r} is not a valid name: use 1-48 lower-case letters, digits or "
            "underscores, starting with a letter or underscore (e.g. schema='asyncjobq')"
        )
    return schema


def check_dsn(dsn: str) -> str:
    """Parse the DSN now, so a typo is reported as such rather than as a connection failure."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as e:
        raise ConfigurationError(
            f"the DSN {redact(dsn)!r} is malformed ({str(e).strip()}): use a URI like "
            "postgresql://user@host:5432/dbname or key=value pairs like 'host=... dbname=...'"
        ) from None
    # libpq parses any port and only rejects a non-number when connecting, where it would
    # read as "cannot connect" rather than as the typo it is.
    port = params.get("port")
    if isinstance(port, str) and any(not re.fullmatch(r"[0-9]*", p) for p in port.split(",")):
        raise ConfigurationError(
            f"the DSN {redact(dsn)!r} is malformed (port {port!r} is not a number): use a URI "
            "like postgresql://user@host:5432/dbname or key=value pairs like 'host=... port=5432'"
        )
    return dsn


def redact(dsn: str) -> str:
    """The DSN without its password, for logs, errors and repr."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # Unparseable: hide anything that looks like a password rather than echo it.
        dsn = re.sub(r"(password\s*=\s*)\S+", r"\1***", dsn)
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", dsn)
    if "password" in params:
        params["password"] = "***"
    return make_conninfo("", **{k: v for k, v in params.items() if v is not None})


def resolve_dsn(dsn: str | None) -> str:
    """The DSN to use: the argument, else $ASYNCJOBQ_DSN, else the embedded server's."""
    if dsn:
        return check_dsn(dsn)
    env = os.environ.get(DSN_ENV)
    if env:
        return check_dsn(env)
    from .embedded import embedded_dsn

    return embedded_dsn()
