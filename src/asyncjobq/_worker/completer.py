"""Buffers outcomes and writes them in one fenced statement per flush, on parallel lanes.

A flush happens when `max_batch` outcomes wait or `flush_interval` after the first one, so a busy
worker pays one round trip and one commit per batch instead of one per job. Each flush also
claims the next jobs for the worker's free slots (Fetcher.fold): completing and claiming cost
one statement, where the article's loop spends two. Several lanes, each with its own
connection, flush at once: with fsync on, a commit waits for the WAL flush, and commits in
flight together share it. A failed flush keeps its outcomes and tries again: nothing is
dropped while the database is away.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import anyio
from psycopg import AsyncCursor

from .._checks import compact_json, storable_text
from .._db.database import Database
from .._db.ownconn import OwnConnection
from .._db.retrying import RETRYABLE, RetryPolicy
from .._db.sql.claim import (
    ANY_OUTCOMES,
    DONE_OUTCOMES,
    LOCKED_DONE_OUTCOMES,
    PLAIN_OUTCOMES,
)
from ..errors import reason
from ..job import log_fields
from .fetcher import Fetcher, FoldedClaim
from .outcome import Outcome

log = logging.getLogger("asyncjobq.completer")
ROLE = "complete"
# The most result JSON one flush carries (a batch is cut short past it): its one parameter
# stays far below jsonb's 256 MiB, whatever the batch size and Queue.max_result_bytes.
RESULT_BYTES = 16 * 2**20


def encode_outcomes(batch: list[Outcome]) -> str:
    """[[id, attempt, kind, delay, error(, result)], ...]: the flush's one JSON parameter. A
    result is JSON text already (executor.done checked it): spliced in, not decoded and
    encoded again."""
    # storable_text: a NUL or a lone surrogate in one exception's message would otherwise
    # fail the whole flush, every time it is retried.
    rows = [[o.job_id, o.attempt, o.kind, o.delay, storable_text(o.error)] for o in batch]
    if all(o.result is None for o in batch):
        return compact_json(rows)
    return "[" + ",".join(
        compact_json(r)[:-1] + "," + o.result + "]" if o.result is not None
        else compact_json(r)
        for r, o in zip(rows, batch, strict=True)) + "]"


def outcomes_of(batch: list[Outcome]) -> int:
    """Which flush the batch needs (_db/sql/claim.py): done without a result, the common
    case, needs no UPDATE of rows that stay; with failures too, no join with the outcomes."""
    plain = DONE_OUTCOMES
    for o in batch:
        if o.result is not None:
            return ANY_OUTCOMES
        if o.kind != "done":
            if o.kind != "failed":
                return ANY_OUTCOMES
            plain = PLAIN_OUTCOMES
    return plain


class Completer:
    def __init__(
        self,
        db: Database,
        worker_id: str,
        *,
        max_batch: int,
        flush_interval: float = 0.005,
        on_written: Callable[[list[Outcome]], None] = lambda _: None,
        on_flushed: Callable[[float], None] | None = None,
        fetcher: Fetcher | None = None,
        lanes: int = 2,
        urgent: frozenset[str] = frozenset(),
    ) -> None:
        self._db = db
        self._worker_id = worker_id
        self._max_batch = max(1, max_batch)
        self._flush_interval = flush_interval
        self._on_written = on_written
        # Seconds each written flush took (the metrics' outcome-flush histogram); None: not
        # timed at all.
        self._on_flushed = on_flushed
        # When set, each flush also claims the next jobs for the fetcher's free slots.
        self._fetcher = fetcher
        self._buffer: list[Outcome] = []
        # Batches taken off the buffer by a flush that has not finished: each batch is written
        # by the flush that took it, and by no other.
        self._inflight: list[list[Outcome]] = []
        self._first_at = 0.0
        # asyncio's own events, not anyio's: a fresh one per change, a few a flush, and anyio's
        # wrapper costs several times its construction and wait.
        self._changed = asyncio.Event()
        self._waiters = 0
        self.refused = 0
        # Kinds of database error the lanes have logged since their last write: one warning
        # per kind for all lanes.
        self._errors_seen: set[str] = set()
        # While run() loops, each lane flushes through a connection of its own (see ownconn).
        self._lanes = [OwnConnection(self._db, ROLE) for _ in range(max(1, lanes))]
        self._idle_lanes = 0  # lanes waiting for a batch (_next_batch)
        # Tasks whose outcomes are written at once, not after flush_interval: a key_limit
        # task's next job of the key can only start once this one's outcome is written.
        self._urgent = urgent

    def pending(self) -> list[tuple[int, int]]:
        """(id, attempt) of jobs whose outcome is not written yet: still running in the table,
        still heartbeated."""
        # tuple(): a copy safe from another thread (the heartbeat's); batches are never mutated.
        held = [(o.job_id, o.attempt) for o in tuple(self._buffer)]
        for batch in tuple(self._inflight):
            held.extend((o.job_id, o.attempt) for o in batch)
        return held

    @property
    def capacity(self) -> int:
        """Outcomes the lanes write at once: a backlog up to this is normal, not a jam."""
        return len(self._lanes) * self._max_batch

    def folds_soon(self) -> bool:
        """A flush is due now (a full batch waits, or the first outcome waited its
        flush_interval) and a lane is free to take it: that flush is about to fold a claim
        (Fetcher.fold). Not while every lane is busy: one waiting on a lock, or backing off
        from a failed write, may not take it for seconds."""
        return bool(self._buffer) and self._idle_lanes > 0 and (
            len(self._buffer) >= self._max_batch
            or self._first_at + self._flush_interval <= time.monotonic())

    @property
    def backlog(self) -> int:
        """Outcomes not written yet: their jobs still count against the worker's slots."""
        return len(self._buffer) + sum(len(b) for b in self._inflight)

    def add(self, outcome: Outcome, *, last: bool = False) -> None:
        """Buffer an outcome. `last`: no other handler of the worker is running, so no other
        outcome can join this batch before a new claim: waiting `flush_interval` for company
        would only delay it (and a `Queue.wait` on its job)."""
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.append(outcome)
        if last or outcome.task in self._urgent:
            self._first_at = -math.inf  # due now
            if self._waiters:
                self._signal()
        elif self._waiters and (len(self._buffer) == 1
                                or len(self._buffer) >= self._max_batch):
            self._signal()

    def _signal(self) -> None:
        # A fresh event per change, so that no waiter can miss one (lanes wait concurrently).
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_changed(self, timeout: float = math.inf) -> None:
        changed = self._changed
        self._waiters += 1
        try:
            if timeout == math.inf:  # no cancel scope: a lane waits so once per flush
                await changed.wait()
            else:
                with anyio.move_on_after(timeout):
                    await changed.wait()
        finally:
            self._waiters -= 1

    def _take(self) -> list[Outcome]:
        batch = self._buffer[: self._max_batch]
        size = 0
        for i, o in enumerate(batch):  # results: at most RESULT_BYTES a flush (one at least)
            size += len(o.result) if o.result is not None else 0
            if size > RESULT_BYTES and i:
                batch = batch[:i]
                break
        del self._buffer[: len(batch)]
        self._inflight.append(batch)
        if self._buffer:
            self._first_at = time.monotonic()
            self._signal()  # another lane may take the rest
        return batch

    def _done_with(self, batch: list[Outcome], *, written: bool) -> None:
        self._inflight.remove(batch)
        if not written:
            if not self._buffer:
                self._first_at = time.monotonic()
            self._buffer.extend(batch)
        self._signal()

    # --- the lanes -------------------------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for own in self._lanes:
                tg.start_soon(self._lane, own)

    async def _lane(self, own: OwnConnection) -> None:
        async with own:
            retry = RetryPolicy(log, "writing outcomes", first=0.05, seen=self._errors_seen)
            while True:
                self._idle_lanes += 1
                try:
                    batch = await self._next_batch()
                finally:
                    self._idle_lanes -= 1
                try:
                    await self._write(own, batch, fold=True)
                    retry.succeeded()
                except RETRYABLE as e:
                    # Any database error (a read-only server, a revoked privilege, a
                    # statement_timeout, an error of the folded claim): _write() put the batch
                    # back, and it is written when the database takes it again.
                    await anyio.sleep(retry.failed(e, f"writing {len(batch)} outcome(s)"))

    async def _next_batch(self) -> list[Outcome]:
        while True:
            timeout = math.inf
            if self._buffer:
                due = self._first_at + self._flush_interval - time.monotonic()
                if len(self._buffer) >= self._max_batch or due <= 0:
                    return self._take()
                timeout = due
            await self._wait_changed(timeout)

    # --- writing ---------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write everything buffered now (a pooled connection, no claim). Raises on a database
        error, keeping the outcomes."""
        while self._buffer:
            await self._write(None, self._take(), fold=False)

    async def _write(self, own: OwnConnection | None, batch: list[Outcome], *,
                     fold: bool) -> None:
        """Write `batch` (already taken off the buffer); on error it goes back to the buffer."""
        params: dict[str, object] = {
            "outcomes": encode_outcomes(batch),
            "worker": self._worker_id,
            "channel": self._db.channel,
            "done": self._db.done_channel,
        }
        plain = outcomes_of(batch)
        if plain == DONE_OUTCOMES and not (own is not None and own.plans_as_worker):
            # The flush of done outcomes alone locks its rows in id order only as workers
            # plan it (sql/claim.py _DONE_ROWS): elsewhere, the same flush locking them first.
            plain = LOCKED_DONE_OUTCOMES
        # The partition the batch's jobs were claimed from (0013_generations.sql); None when
        # they come from both, or are unknown: the statement names jobs, every partition.
        gens = {self._gen_of(o) for o in batch}
        gen = gens.pop() if len(gens) == 1 else None
        claim = (self._fetcher.fold(plain, gen) if fold and self._fetcher is not None
                 else None)
        written = False  # the first statement committed: the batch is not sent again
        later: list[Outcome] = []  # outcomes to write again: their second look did not end
        started = time.monotonic() if self._on_flushed is not None else 0.0
        try:
            conn_cm = own.connection() if own is not None else self._db.connection()
            async with conn_cm as conn:
                cur = own.cursor(conn) if own is not None else conn.cursor()
                if claim is None:
                    accepted = await self._set_outcomes(cur, params, plain, gen)
                else:
                    accepted = await self._set_outcomes_then_claim(cur, params, claim)
                    claim = None  # committed and handed out, whatever follows
                written = True
                # A job the leader's rotation moved while it ran is in the other partition
                # now: its outcome is looked for in every one, by a statement of its own.
                # Also when the first named `jobs`: a move that committed while it waited
                # for the row left it the deleted version, and the moved one came after its
                # snapshot. If this one fails or is cancelled, only these go back. (None
                # left when the refused outcome is an older attempt of a job whose newer one
                # was accepted.)
                again = ([o for o in batch if o.job_id not in accepted]
                         if len(accepted) < len(batch) else [])
                if again:
                    later = again
                    try:
                        accepted |= await self._set_outcomes(
                            cur, {**params, "outcomes": encode_outcomes(again)}, plain, None)
                        later = []
                    except RETRYABLE as e:
                        log.warning("%d outcome(s) refused by a flush could not be looked "
                                    "for again (%s): the next flush writes them", len(again),
                                    reason(e))
        finally:
            if claim is not None and not written:
                assert self._fetcher is not None
                self._fetcher.folded_failed(claim)
            if later:
                # Back in the buffer before they leave the flush in flight: the heartbeat
                # renews the leases of both (pending()), and must not miss them between.
                self._requeue(later)
            self._done_with(batch, written=written)
        if later:
            batch = [o for o in batch if o not in later]
        if self._fetcher is not None:
            for o in batch:
                self._fetcher.gen_of.pop((o.job_id, o.attempt), None)
        for o in batch:
            if o.job_id not in accepted:
                self.refused += 1
                log.warning(
                    "job %s (%s) attempt %s: outcome %r refused, the job is no longer held "
                    "by this worker (its lease expired and it was reaped); another attempt "
                    "owns it now", o.job_id, o.task or "?", o.attempt, o.kind,
                    extra=log_fields(o.job_id, o.task or None, attempt=o.attempt))
        if self._on_flushed is not None:
            self._on_flushed(time.monotonic() - started)
        self._on_written([o for o in batch if o.job_id in accepted])

    def _requeue(self, outcomes: list[Outcome]) -> None:
        """Buffer outcomes again (written by no flush yet): the next flush writes them."""
        if not self._buffer:
            self._first_at = time.monotonic()
        self._buffer.extend(outcomes)
        self._signal()

    def _gen_of(self, o: Outcome) -> int | None:
        f = self._fetcher
        return f.gen_of.get((o.job_id, o.attempt)) if f is not None else None

    async def _set_outcomes(self, cur: AsyncCursor[Any], params: dict[str, object],
                            plain: int = ANY_OUTCOMES, gen: int | None = None) -> set[int]:
        st = self._db.sql_of(gen, plain)
        await cur.execute(st.job_set_outcome_if_running_many, params)
        return {int(r[0]) for r in await cur.fetchall()}

    async def _set_outcomes_then_claim(
        self, cur: AsyncCursor[Any], params: dict[str, object], claim: FoldedClaim,
    ) -> set[int]:
        assert self._fetcher is not None
        await cur.execute(claim.query, {**params, **claim.params})
        rows = await cur.fetchall()
        # true: a claimed job; false: an accepted outcome; NULL: a marker row (a limited
        # claim's held rows, a claim's floors).
        self._fetcher.folded_claimed([r[1:] for r in rows if r[0] is not False], claim)
        return {int(r[1]) for r in rows if r[0] is False}

    # --- shutdown --------------------------------------------------------------------------

    async def settle(self, timeout: float) -> None:
        """Wait out flushes in flight that claim: they may still hand jobs to the fetcher."""
        with anyio.move_on_after(timeout):
            while self._fetcher is not None and self._fetcher.reserved:
                await self._wait_changed()

    async def drain(self, timeout: float) -> bool:
        """Shutdown: flush until nothing is buffered or in flight, or `timeout` passes; True
        when everything was written."""
        retry = RetryPolicy(log, "final flush", first=0.2, most=1.0, seen=self._errors_seen)
        with anyio.move_on_after(timeout):
            while self._buffer or self._inflight:
                if not self._buffer:
                    await self._wait_changed()
                    continue
                try:
                    await self.flush()
                    retry.succeeded()
                except RETRYABLE as e:
                    await anyio.sleep(retry.failed(e))
        left = self.backlog
        if left:
            log.error("%d outcome(s) not written at shutdown; those jobs will be reaped after "
                      "their lease and run again", left)
            return False
        return True
