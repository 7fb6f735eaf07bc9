"""Leadership: one worker per schema runs the once-per-fleet maintenance services.

The leader holds the `leader` row (_db/migrations/0002_leader.sql) and renews it every third
of its lease.
It acts as leader only until its last renewal's lease would run out *as measured from when the
renewal was sent*: the server set the row's expiry no earlier than that, and other workers take
the row only after the server's clock passes it, so two workers never act as leader at once
(beyond a maintenance turn already under way when the lease ran out). A leader that stops
resigns, so another takes over at its next attempt instead of waiting for the expiry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

import psycopg
from psycopg_pool import PoolTimeout

from .services import Service

if TYPE_CHECKING:
    from .._db.database import Database

log = logging.getLogger("asyncjobq.leader")


class Elector(Service):
    """A maintenance service of its own (services.py): each turn elects or renews."""

    name = "leader"
    eager = True

    def __init__(self, db: Database, worker_id: str, *, ttl: float,
                 on_change: Callable[[str | None], None] | None = None) -> None:
        self._db = db
        self._worker_id = worker_id
        self.ttl = ttl
        self.interval = ttl / 3
        # A renewal that lands after the lease is worth nothing: give it up and try again.
        self.timeout = ttl
        self.max_backoff = self.interval
        self._on_change = on_change
        # Its own connection: handlers holding every pooled one must not cost the lease.
        self._conn = self.use_own_connection(db, "leader")
        self._valid_until = 0.0  # monotonic; leader while now is before it
        # A turn ended without its reply: it may have written the row all the same.
        self._unsure = False
        self.leader: str | None = None  # the leader this worker saw last
        self.since: datetime | None = None
        self.terms = 0  # times this worker became leader

    @property
    def is_leader(self) -> bool:
        return time.monotonic() < self._valid_until

    async def turn(self) -> None:
        sent = time.monotonic()
        try:
            async with self._conn.connection() as conn:
                cur = await conn.execute(self._db.sql.leader_elect,
                                         {"worker": self._worker_id, "ttl": self.ttl})
                row = await cur.fetchone()
        except BaseException:
            # Unknown whether the renewal landed: what was held is held until it runs out.
            self._unsure = True
            if self.leader == self._worker_id and not self.is_leader:
                self._observe(None, None)
            raise
        self._unsure = False
        leader, since = (str(row[0]), row[1]) if row else (None, None)
        held = bool(row[2]) if row else False
        if leader == self._worker_id and not held:
            # A snapshot from before another worker's takeover (sql/maintenance.py): not ours.
            leader, since = None, None
        was = self.is_leader
        if held and leader == self._worker_id:
            self._valid_until = sent + self.ttl
            if not was:
                self.terms += 1
                log.info("worker %s is now the leader of schema %s", self._worker_id,
                         self._db.schema)
        elif was:
            self._valid_until = 0.0
            log.warning("worker %s lost the leadership of schema %s to %s", self._worker_id,
                        self._db.schema, leader)
        self._observe(leader, since)

    def _observe(self, leader: str | None, since: datetime | None) -> None:
        if leader == self.leader:
            return
        self.leader, self.since = leader, since
        if self._on_change is not None:
            self._on_change(leader)

    async def resign(self) -> None:
        """Give the row up (on stop, once no turn runs), so that another worker leads at its
        next turn. Also when the last turn was cut off: it may have taken the row."""
        was = self.is_leader
        if not was and not self._unsure:
            return
        self._valid_until = 0.0
        try:
            async with self._conn.connection() as conn:
                await conn.execute(self._db.sql.leader_resign, {"worker": self._worker_id})
        except (psycopg.Error, PoolTimeout):
            if was:
                raise
            return  # a row that cut-off turn may have written expires after one lease
        self._unsure = False
        if was:
            log.info("worker %s resigned the leadership of schema %s", self._worker_id,
                     self._db.schema)
