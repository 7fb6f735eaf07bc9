"""Numbered migrations, the .sql files beside this module (package data, shipped in the
wheel), applied in order under an advisory lock."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import psycopg
from psycopg import sql

from ...errors import SchemaNotInstalledError, SchemaVersionError
from ..retrying import DEADLOCK_TRIES
from ..sql import IndexDefinition, statements

_NAME_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str


def _sql_dir() -> Traversable:
    return resources.files(__package__ or __name__)


def available() -> list[Migration]:
    found = []
    for path in sorted(_sql_dir().iterdir(), key=lambda p: p.name):
        m = _NAME_RE.match(path.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    return found


_INDEX_RE = re.compile(
    r"CREATE\s+(UNIQUE\s+)?INDEX\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)\s+ON\s+(\w+)\s+([^;]*);"
    r"|DROP\s+INDEX\s+(?:IF\s+EXISTS\s+)?(\w+)",
    re.IGNORECASE)


def expected_indexes() -> dict[str, IndexDefinition]:
    """{index name: its definition} as the migrations leave them (created, not dropped since)."""
    found: dict[str, IndexDefinition] = {}
    for m in available():
        for match in _INDEX_RE.finditer(m.text):
            unique, name, table, definition, dropped = match.groups()
            if dropped:
                found.pop(dropped, None)
            else:
                found[name] = IndexDefinition(name, table, bool(unique),
                                              " ".join(definition.split()))
    return found


def latest_version() -> int:
    return max(m.version for m in available())


def _refuse_newer(done: set[int], schema: str) -> None:
    newest = latest_version()
    if done and max(done) > newest:
        raise SchemaVersionError(
            f"schema {schema} is at version {max(done)}, newer than this asyncjobq "
            f"(knows up to {newest}): upgrade asyncjobq (pip install -U asyncjobq)"
        )


# Installs that PostgreSQL ended as one side of a deadlock are tried again (DEADLOCK_TRIES in
# all). A migration that changes `jobs` locks it and its partitions; a statement of a running
# worker can hold one partition and want another table of the set (a limited claim reads
# `jobs` while it updates its partition), and the deadlock detector ends one of the two after
# deadlock_timeout.


async def apply(conn: psycopg.AsyncConnection[Any], schema: str) -> list[int]:
    """Apply the missing migrations in one transaction; returns the versions applied.

    The advisory lock serialises concurrent installs (CREATE SCHEMA IF NOT EXISTS alone races).
    """
    for attempt in range(1, DEADLOCK_TRIES + 1):
        try:
            return await _apply(conn, schema)
        except psycopg.errors.DeadlockDetected:
            if attempt == DEADLOCK_TRIES:
                raise
            # The other side's statement gets a moment to end before the locks are asked again.
            await asyncio.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


async def _apply(conn: psycopg.AsyncConnection[Any], schema: str) -> list[int]:
    st = statements(schema)
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute(st.install_lock)
        await conn.execute(st.schema_create)
        await conn.execute(st.migrations_table_create)
        cur = await conn.execute(st.migration_versions)
        done = {int(v) for (v,) in await cur.fetchall()}
        _refuse_newer(done, schema)
        await conn.execute(st.search_path_set_local)
        for m in available():
            if m.version in done:
                continue
            await conn.execute(sql.SQL(m.text))
            await conn.execute(st.migration_record, (m.version, m.name))
            applied.append(m.version)
    return applied


async def check(conn: psycopg.AsyncConnection[Any], schema: str) -> None:
    """Raise unless the schema is installed at exactly the versions this code knows."""
    st = statements(schema)
    cur = await conn.execute(st.migrations_table_exists)
    row = await cur.fetchone()
    if not row or not row[0]:
        raise SchemaNotInstalledError(
            f"schema {schema} is not installed: run `python -m asyncjobq install` "
            "(or `await queue.install()`)"
        )
    cur = await conn.execute(st.migration_versions)
    done = {int(v) for (v,) in await cur.fetchall()}
    _refuse_newer(done, schema)
    missing = [m.version for m in available() if m.version not in done]
    if missing:
        raise SchemaNotInstalledError(
            f"schema {schema} lacks migrations {missing}: run `python -m asyncjobq install`"
        )
