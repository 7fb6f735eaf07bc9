"""The one LISTEN connection: wakes the fetcher on notifications, reconnects with backoff.

Every (re)connection also wakes the fetcher, since notifications sent while the connection was
down are lost; the fetcher also hears when it goes down (its floors rest on notifications,
floors.py). A quiet connection is probed every `keepalive` seconds so that a silently dead
one is noticed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from psycopg import AsyncConnection, sql

from .._db.dsn import redact
from .._db.retrying import RETRYABLE, RetryPolicy

log = logging.getLogger("asyncjobq.listener")
RETRY_ON: tuple[type[Exception], ...] = (*RETRYABLE, OSError)


class Listener:
    def __init__(
        self,
        dsn: str,
        channel: str,
        on_notify: Callable[[str | None, float | None, Sequence[Any] | None], None],
        on_connect: Callable[[], None],
        *,
        on_disconnect: Callable[[], None] = lambda: None,
        keepalive: float = 10.0,
        application_name: str = "asyncjobq-listen",
        also: dict[str, Callable[[str], None]] | None = None,
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._on_notify = on_notify
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._keepalive = keepalive
        self._application_name = application_name
        # Other channels heard on the same connection, each with its own handler of payloads.
        self._also = dict(also or {})
        self.connected = anyio.Event()
        self.connects = 0
        self.backend_pid: int | None = None
        self._retry = RetryPolicy(log, f"LISTEN connection to {redact(dsn)}")

    async def run(self) -> None:
        retry = self._retry
        while True:
            try:
                await self._listen()
            except RETRY_ON as e:
                # Any database error too: a standby refuses LISTEN ("cannot execute LISTEN
                # during recovery") until it is promoted.
                self.backend_pid = None
                await anyio.sleep(retry.failed(e))

    async def _listen(self) -> None:
        conn = await AsyncConnection.connect(self._dsn, autocommit=True, connect_timeout=10,
                                             application_name=self._application_name)
        listening = False
        try:
            for channel in (self._channel, *self._also):
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            listening = True
            self.backend_pid = conn.info.backend_pid
            self.connects += 1
            if self.connects > 1:
                log.info("LISTEN connection re-established")
            self.connected.set()
            self._retry.succeeded()
            self._on_connect()
            while True:
                async for n in conn.notifies(timeout=self._keepalive):
                    other = self._also.get(n.channel)
                    if other is not None:
                        other(n.payload)
                    else:
                        self._dispatch(n.payload)
                await conn.execute("SELECT 1")
        finally:
            if listening:
                self._on_disconnect()
            await conn.close()

    def _dispatch(self, payload: str) -> None:
        try:
            msg = json.loads(payload)
            queue = str(msg["queue"])
            run_at = msg.get("run_at")
            # [[priority, earliest run_at], ...] of the rows it made queued; absent from a
            # hand-made NOTIFY: the fetcher then looks at the queue's every lane.
            lanes = msg.get("lanes")
            if lanes is not None and not isinstance(lanes, list):
                raise TypeError("lanes")
            self._on_notify(queue, float(run_at) if run_at is not None else None, lanes)
        except (ValueError, KeyError, TypeError):
            # Someone NOTIFYed our channel by hand: treat it as "something may be due".
            log.debug("unrecognised notification payload %r; waking anyway", payload[:200])
            self._on_notify(None, None, None)
