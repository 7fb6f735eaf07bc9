"""A faster jsonb loader for the worker's own connections, only while the app reads JSON as
psycopg does by default.

psycopg's default loader hands the bytes to json.loads, which sniffs their encoding first
(UTF-8, -16 or -32) on every value: about a fifth of the cost of reading a claimed job's payload.
PostgreSQL sends jsonb as UTF-8 text, so this one decodes UTF-8 and parses, with the same result.
An app that changes how psycopg reads JSON keeps its way: a loader of its own registered for
jsonb when the connection opens leaves this one out (install()), and one set for the whole
process by psycopg's set_json_loads, even later, is used by this one's every load.
"""

from __future__ import annotations

import json
from typing import Any

from psycopg import AsyncConnection
from psycopg.adapt import Buffer
from psycopg.pq import Format
from psycopg.types.json import JsonbLoader, _JsonLoader

_decode = json.JSONDecoder().decode


class FastJsonbLoader(JsonbLoader):
    def load(self, data: Buffer) -> Any:
        loads = _JsonLoader._loads
        if loads is not json.loads:  # set_json_loads() since: the app's, as psycopg would
            return loads(bytes(data))
        return _decode(str(data, "utf-8", "surrogatepass"))


def install(conn: AsyncConnection[Any]) -> None:
    """Read jsonb on `conn` with FastJsonbLoader if it would use psycopg's default loader."""
    info = conn.adapters.types.get("jsonb")
    if info is None:
        return
    current = conn.adapters.get_loader(info.oid, Format.TEXT)
    if current is JsonbLoader and _JsonLoader._loads is json.loads:
        conn.adapters.register_loader("jsonb", FastJsonbLoader)
