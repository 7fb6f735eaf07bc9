"""Writes the progress handlers report (`job.set_progress`), coalesced: the last value of each
job once a second at most, all of them in one statement. Nothing runs while no handler reports
progress."""

from __future__ import annotations

import asyncio
import logging
import threading

import psycopg
from psycopg_pool import PoolTimeout

from .._db.database import Database
from ..errors import reason

log = logging.getLogger("asyncjobq.worker")

Key = tuple[int, int]  # (job id, attempt)
# A second between writes: a handler calling set_progress in a tight loop costs one UPDATE
# per second for all its jobs.
INTERVAL = 1.0


class ProgressWriter:
    def __init__(self, db: Database, worker_id: str) -> None:
        self._db = db
        self._worker_id = worker_id
        # Sync handlers report from their threads: the swap and the puts take turns.
        self._lock = threading.Lock()
        self._pending: dict[Key, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wake: asyncio.Event | None = None
        self.writes = 0

    def put(self, job_id: int, attempt: int, value: str) -> None:
        """The latest progress of an attempt (JSON text, checked by Job.set_progress)."""
        with self._lock:
            first = not self._pending
            self._pending[job_id, attempt] = value
        loop, wake = self._loop, self._wake
        if not first or loop is None or wake is None:
            return  # the loop was woken already, or writes once run() starts
        if threading.get_ident() == self._loop_thread:
            wake.set()
        else:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # the loop is closed: the worker is gone

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        wake = self._wake = asyncio.Event()
        while True:
            if not self._pending:
                await wake.wait()
            wake.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
            await self._write(batch)
            await asyncio.sleep(INTERVAL)

    async def _write(self, batch: dict[Key, str]) -> None:
        keys = sorted(batch)
        try:
            async with self._db.connection() as conn:
                await conn.execute(self._db.sql.job_set_progress_many, {
                    "ids": [k[0] for k in keys], "attempts": [k[1] for k in keys],
                    "values": [batch[k] for k in keys], "worker": self._worker_id})
            self.writes += 1
        except (psycopg.OperationalError, PoolTimeout) as e:
            # The database is away: written once it is back, unless the handler reported a
            # newer value meanwhile.
            log.debug("progress of %d job(s) not written (%s)", len(batch), reason(e))
            with self._lock:
                for k in keys:
                    self._pending.setdefault(k, batch[k])
        except psycopg.Error as e:
            # Refused (a revoked privilege, a read-only server...): kept, it would be refused
            # again every second. Progress is a status: the handler's next value replaces it.
            log.warning("progress of %d job(s) not written: %s", len(batch), reason(e))
