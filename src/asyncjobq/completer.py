"""Buffers outcomes and writes them in one fenced statement per flush.

A flush happens when `max_batch` outcomes wait or `flush_interval` after the first one, so a busy
worker pays one round trip and one commit per batch instead of one per job. A failed flush keeps
its outcomes and tries again: nothing is dropped while the database is away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import psycopg
from psycopg_pool import PoolTimeout

from .errors import reason
from .heldconn import HeldConnection
from .outcome import Outcome
from .queue import Queue

log = logging.getLogger("asyncjobq.worker")
ROLE = "complete"


class Completer:
    def __init__(
        self,
        queue: Queue,
        worker_id: str,
        *,
        max_batch: int,
        flush_interval: float = 0.005,
        on_written: Callable[[list[Outcome]], None] = lambda _: None,
    ) -> None:
        self._queue = queue
        self._worker_id = worker_id
        self._max_batch = max(1, max_batch)
        self._flush_interval = flush_interval
        self._on_written = on_written
        self._buffer: list[Outcome] = []
        self._ready = anyio.Event()
        self._first_at = 0.0
        # run() and drain() may both flush at shutdown; each batch must be taken off the
        # buffer by the flush that wrote it, and by no other.
        self._flushing = anyio.Lock()
        self.refused = 0
        # While run() loops, flushes go through a connection of its own (see heldconn).
        self._held = HeldConnection(self._queue, ROLE)

    def pending_ids(self) -> list[int]:
        """Jobs whose outcome is not written yet: still running in the table, still heartbeated."""
        return [o.job_id for o in tuple(self._buffer)]  # tuple(): safe from another thread

    @property
    def backlog(self) -> int:
        """Outcomes not written yet: their jobs still count against the worker's slots."""
        return len(self._buffer)

    def add(self, outcome: Outcome) -> None:
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.append(outcome)
        self._ready.set()

    async def run(self) -> None:
        async with self._held:
            await self._run()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._buffer:
                await self._ready.wait()
                self._ready = anyio.Event()
                continue
            wait = self._first_at + self._flush_interval - time.monotonic()
            if len(self._buffer) < self._max_batch and wait > 0:
                with anyio.move_on_after(wait):
                    while len(self._buffer) < self._max_batch:
                        await self._ready.wait()
                        self._ready = anyio.Event()
            try:
                await self.flush()
                backoff = 0.05
            except (psycopg.OperationalError, PoolTimeout) as e:
                log.warning("writing %d outcome(s) failed (%s); retrying in %.1f s",
                            len(self._buffer), reason(e),
                            backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def flush(self) -> None:
        """Write everything buffered now. Raises on a database error, keeping the buffer."""
        async with self._flushing:
            while self._buffer:
                # Flushes of max_batch rows: the completion statement's cost grows faster than
                # its row count (its plan joins outcomes to this worker's running rows).
                await self._flush_batch(self._buffer[: self._max_batch])

    async def _flush_batch(self, batch: list[Outcome]) -> None:
        async with self._held.connection() as conn:
            cur = await conn.execute(
                self._queue.sql.job_set_outcome_if_running_many,
                {
                    "ids": [o.job_id for o in batch],
                    "attempts": [o.attempt for o in batch],
                    "kinds": [o.kind for o in batch],
                    "delays": [o.delay for o in batch],
                    "errors": [o.error for o in batch],
                    "worker": self._worker_id,
                },
            )
            accepted = {int(r[0]) for r in await cur.fetchall()}
        del self._buffer[: len(batch)]
        if self._buffer:
            self._first_at = time.monotonic()
        for o in batch:
            if o.job_id not in accepted:
                self.refused += 1
                log.warning(
                    "job %s attempt %s: outcome %r refused, the job is no longer held by "
                    "this worker (its lease expired and it was reaped); another attempt "
                    "owns it now", o.job_id, o.attempt, o.kind)
        self._on_written([o for o in batch if o.job_id in accepted])

    async def drain(self, timeout: float) -> bool:
        """Shutdown: flush until empty or `timeout` passes; True when everything was written."""
        with anyio.move_on_after(timeout):
            while self._buffer:
                try:
                    await self.flush()
                except (psycopg.OperationalError, PoolTimeout) as e:
                    log.warning("final flush failed (%s); retrying", reason(e))
                    await anyio.sleep(0.2)
        if self._buffer:
            log.error("%d outcome(s) not written at shutdown; those jobs will be reaped after "
                      "their lease and run again", len(self._buffer))
            return False
        return True
