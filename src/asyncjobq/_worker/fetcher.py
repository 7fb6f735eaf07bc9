"""Claims batches of due jobs, sized to the free handler slots, and waits well when idle.

After a full batch it claims again at once, unless a flush about to be written will claim for
the free slots (_defer); after a short one it sleeps until a notification, the earliest known
due run_at, or poll_interval (the safety net for lost notifications). While jobs flow, most
claims ride on the completer's flushes instead (fold()): the slots they will fill are reserved
until the flush returns, so the two never claim past concurrency.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import psycopg
from psycopg_pool import PoolTimeout

from .._db.database import Database
from .._db.ownconn import OwnConnection
from .._db.retrying import RETRYABLE, Backoff, RetryPolicy
from .._db.sql import Statement
from .._db.sql.claim import WorkerStatements
from ..errors import reason
from ..job import Job, JobControl, claimed_job
from .floors import Floors

log = logging.getLogger("asyncjobq.fetcher")
ROLE = "fetch"
# A job whose claim reply was lost this many times in a row is released with its attempt
# counted: a row whose reply never arrives (one the driver cannot decode, say) must not be
# claimed for ever. Remembered for this many jobs at most.
LOST_CLAIM_TIMES = 3
LOST_CLAIM_MEMORY = 10_000
# A claim held rows back for a concurrency or key limit: claim again this soon, doubling while
# claims come back with nothing, up to poll_interval (so poll_interval bounds how long a slot
# freed by another worker waits to be seen here). The worker that finishes the job holding the
# slot usually starts the next one in the same flush; this is for the other workers, which no
# notification tells.
HELD_RETRY = 0.1
# A claim held rows back for a rate limit: wait as long as the database says the window stays
# full, but at least this long, doubling while claims come back with nothing, up to
# poll_interval. A window that frees as the claim ends (a wait of zero) would otherwise be
# claimed again at once, and every such claim queues on the task's lock in flow_admit with the
# other workers' claims of it.
RATE_RETRY = 0.02
# Claims from floors (floors.py, docs/how-it-works/storage.md): "1" always, "0" never, unset
# while the xmin horizon is held (HORIZON_CHECK). They keep a pinned horizon from slowing the
# claims (2,000 jobs/s offered, 120 s pinned: 100 % kept instead of 40 %), but cost an
# unpinned drain about 13 % (benchmarks/limits_ab.py against the code without them).
FLOORS_ENV = "ASYNCJOBQ_CLAIM_FLOORS"
# How often a worker whose floors follow the horizon asks whether it is held, and how many
# answers in a row switch floors on, and off.
HORIZON_CHECK = 1.0
HORIZON_ON = 2
HORIZON_OFF = 5
# How often a worker reads which generation of jobs is current (0013_generations.sql), besides
# the notification the switch sends: claims of a worker that missed it read the partition the
# leader empties of queued rows (_maintenance/rotation.py) until it looks again.
GENERATION_CHECK = 1.0


class Wakeup:
    """A resettable event with alarm times: every due time it was told of wakes it once."""

    # Past this many pending alarms the latest are dropped: poll_interval still finds them.
    MAX_ALARMS = 1024

    def __init__(self) -> None:
        # asyncio's event, not anyio's: made anew after every wait (see completer.py).
        self._event = asyncio.Event()
        self._alarms: list[float] = []  # monotonic times, a heap

    def set(self) -> None:
        self._event.set()

    def at(self, when: float) -> None:
        """Wake at monotonic time `when`, as well as at every other time already set."""
        earliest = not self._alarms or when < self._alarms[0]
        if len(self._alarms) >= self.MAX_ALARMS:
            if when >= max(self._alarms):
                return
            self._alarms.remove(max(self._alarms))
            heapq.heapify(self._alarms)
        heapq.heappush(self._alarms, when)
        if earliest:
            # Interrupt a wait already in progress so that it re-arms with the earlier alarm.
            self._event.set()

    async def wait(self, timeout: float) -> None:
        if self._alarms:
            timeout = min(timeout, max(0.0, self._alarms[0] - time.monotonic()))
        with anyio.move_on_after(timeout):
            await self._event.wait()
        now = time.monotonic()
        while self._alarms and self._alarms[0] <= now:
            heapq.heappop(self._alarms)
        self._event = asyncio.Event()


class FoldedClaim(NamedTuple):
    """A claim for the completer to add to its flush (Fetcher.fold)."""

    query: Statement
    params: dict[str, object]
    reserved: int  # slots held for it until folded_claimed() or folded_failed()
    token: int | None  # its floors' (floors.py), when it claims from floors
    gen: int | None  # the partition it claims from (None: jobs, all of them)


class Fetcher:
    def __init__(
        self,
        db: Database,
        worker_id: str,
        queues: Sequence[str],
        *,
        batch_size: int,
        concurrency: int,
        poll_interval: float,
        free_slots: Callable[[], int],
        dispatch: Callable[[Job], None],
        keep: Callable[[], list[tuple[int, int]]] = list,
        claimed: Callable[[list[Job]], None] | None = None,
        limits: dict[str, dict[str, object]] | None = None,
        control: JobControl | None = None,
        folding: Callable[[], bool] = lambda: False,
    ) -> None:
        self._db = db
        # Whether outcomes wait whose flush will fold a claim (Completer.folds_soon), and
        # whether the last fold() declined for their generation.
        self._folding = folding
        self._fold_declined = False
        self._worker_id = worker_id
        self._control = control  # lent to each Job (cancel_requested, set_progress)
        # The last claim found fewer jobs than it asked for: nothing more is due now, as far
        # as it saw (the completer then writes a lone outcome at once, worker.py).
        self.found_less = True
        # Unique: a queue named twice would fill half of each claim with the same rows.
        self._queues = list(dict.fromkeys(queues))
        self._batch_size = batch_size
        self._concurrency = concurrency
        self._poll_interval = poll_interval
        self._free_slots = free_slots
        self._dispatch = dispatch
        # (id, attempt) of the rows a release of lost claim rows must leave alone: the jobs the
        # worker runs or has not written the outcome of, and those it let go (Running.keep).
        self._keep = keep
        self._claimed = claimed  # told of each claimed batch, before it is dispatched
        # A claim failed after it was sent: it may have committed, its rows then held in the
        # table by this worker with no handler. They are released before the next claim.
        self._suspect = False
        self.released = 0
        # id -> lost replies of one-row claims of it since this worker last received it: from
        # the LOST_CLAIM_TIMES-th on, each release counts the attempt (job_release_lost_claims).
        self._lost: dict[int, int] = {}
        # Rows in the claim whose reply was lost last; 1 means the lost reply was that row's.
        self._lost_limit = 0
        # Claims left to make one row at a time: after a batch's reply was lost, each of its
        # rows is claimed alone, so that only the row whose reply cannot arrive is charged.
        self._narrow = 0
        self.wakeup = Wakeup()
        self.slot_freed = asyncio.Event()  # set by every job's end: asyncio's, cheaper
        self.stopping = False
        self.claimed = 0
        # Slots promised to a claim folded into a flush that is still in flight.
        self._reserved = 0
        # While run() loops, claims go through a connection of its own (see ownconn).
        self._own = OwnConnection(self._db, ROLE)
        # The limited tasks' limits, sent with every claim (sql/claim.py, `_limited`); None:
        # no limited task, the plain claim.
        self._limits = json.dumps(limits, sort_keys=True) if limits else None
        self.held_back = 0  # rows limits held back, summed over claims
        # While claims come back with nothing because a limit holds their rows back, they
        # are retried after this long, doubling up to poll_interval: a limit that stays full
        # costs a claim a poll_interval.
        self._held_retry = Backoff(HELD_RETRY, poll_interval)
        self._rate_retry = Backoff(RATE_RETRY, poll_interval)
        # Where each lane's claim starts; in use while the LISTEN connection is up (the
        # listener calls listening()/deaf()) and no limited task is served (the limited claims
        # walk their lanes from the start).
        self.floors = Floors(self._queues, enabled=False)
        self._listening = False
        self.horizon_held = False
        # The generation of jobs whose partition claims name (0013_generations.sql); None
        # until read, and for limited claims: they read every partition. gen_of: each
        # running attempt's (id, attempt), for the completer, which writes outcomes to the
        # partition their jobs were claimed from.
        self.gen: int | None = None
        self.gen_of: dict[tuple[int, int], int | None] = {}

    @property
    def single_queue(self) -> bool:
        return len(self._queues) == 1

    def serves(self, queue: str) -> bool:
        return queue in self._queues

    def listening(self) -> None:
        """The LISTEN connection is (again) up: notifications sent while it was down are lost,
        so floors start over from a walk of every lane."""
        self._listening = True
        self.floors.forget()
        self._use_floors()
        self.wakeup.set()

    def deaf(self) -> None:
        """The LISTEN connection went down: no notification lowers a floor meanwhile."""
        self._listening = False
        self.floors.forget()
        self._use_floors()

    def _use_floors(self) -> None:
        mode = os.environ.get(FLOORS_ENV)
        use = (self._listening and self._limits is None and mode != "0"
               and (mode == "1" or self.horizon_held))
        if use and not self.floors.enabled:
            self.wakeup.set()  # its own claim discovers the lanes; folded ones cannot
        # Switched off and on again while listening, floors stay what they were: every
        # notification lowered them meanwhile, they are only staler.
        self.floors.enabled = use

    async def watch_horizon(self) -> None:
        """While floors follow the horizon: ask every HORIZON_CHECK seconds whether a session
        holds it (sql/claim.py, horizon_held); floors go on after HORIZON_ON such answers in a
        row, off after HORIZON_OFF of the other, so that one long statement does not flip
        them. Best effort: an error leaves them as they are."""
        if os.environ.get(FLOORS_ENV) in ("0", "1") or self._limits is not None:
            return
        streak = 0
        while not self.stopping:
            await anyio.sleep(HORIZON_CHECK)
            if not self._listening:
                continue
            try:
                async with self._db.connection() as conn:
                    cur = await conn.execute(self._db.sql.horizon_held,
                                             {"seconds": HORIZON_CHECK})
                    row = await cur.fetchone()
            except Exception as e:  # a monitor: the claims themselves report the database
                log.debug("could not tell whether the xmin horizon is held: %s", reason(e))
                continue
            held = bool(row and row[0])
            streak = streak + 1 if held != self.horizon_held else 0
            if streak >= (HORIZON_ON if held else HORIZON_OFF):
                streak = 0
                self.horizon_held = held
                log.info("the xmin horizon is %s: claims %s", "held by a session" if held
                         else "free again", "start from floors" if held
                         else "walk each lane from its start")
                self._use_floors()

    def generation_notified(self, payload: str) -> None:
        """The leader made another generation current (its notification's payload)."""
        try:
            gen = int(payload)
        except ValueError:
            return
        if gen != self.gen:
            self._switch(gen)

    def _switch(self, gen: int | None) -> None:
        if self.gen is not None:
            log.debug("jobs generation %s is current: claims read jobs_%s", gen, gen)
        self.gen = gen
        # Each lane's floor is a position among its rows, wherever they are: still right.
        self.wakeup.set()

    async def watch_generation(self) -> None:
        """Read the current generation now and every GENERATION_CHECK seconds: a worker that
        missed the switch's notification (its LISTEN connection down, or none behind a
        pooler) learns it here. Best effort: an error keeps the one it knew."""
        while not self.stopping:
            try:
                async with self._db.connection() as conn:
                    cur = await conn.execute(self._db.sql.generation_current)
                    row = await cur.fetchone()
                if row is not None and row[0] != self.gen:
                    self._switch(int(row[0]))
            except Exception as e:  # a monitor: the claims themselves report the database
                log.debug("could not read the current generation of jobs: %s", reason(e))
            await anyio.sleep(GENERATION_CHECK)

    def notify(self, queue: str | None, run_at_epoch: float | None,
               lanes: Sequence[Any] | None = ()) -> None:
        """A notification says `queue` (None: any) has a job due then; `lanes` are the
        priorities and earliest run_at of the rows it made queued (None: it did not say)."""
        if queue is None:
            for q in self._queues:
                self.floors.lower(q, None)
        elif queue not in self._queues:
            return
        elif lanes != ():
            self.floors.lower(queue, lanes)
        if run_at_epoch is None:
            self.wakeup.set()
            return
        delay = run_at_epoch - time.time()
        if delay <= 0:
            self.wakeup.set()
        else:
            self.wakeup.at(time.monotonic() + delay)

    def release_slot(self) -> None:
        self.slot_freed.set()

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.slot_freed.set()

    def _claim_params(self, limit: int) -> dict[str, object]:
        params: dict[str, object] = (
            {"queue": self._queues[0], "worker": self._worker_id, "limit": limit}
            if self.single_queue else
            {"queues": self._queues, "worker": self._worker_id, "limit": limit})
        if self._limits is not None:
            params["limits"] = self._limits
        return params

    def _jobs(self, rows: Sequence[Sequence[Any]], token: int | None = None,
              gen: int | None = None) -> list[Job]:
        if token is not None:
            floors = [r[3] for r in rows if r[0] is None and r[1] == WorkerStatements.FLOORS_MARKER]
            if floors:
                self.floors.settle(token, floors[0])
            else:
                self.floors.abandon(token)
        worker, control = self._worker_id, self._control
        jobs = [
            claimed_job(id=r[0], task=r[1], queue=r[2], payload=r[3], priority=r[4],
                        attempt=r[5], max_attempts=r[6], run_at=r[7], created_at=r[8],
                        worker=worker, trace_context=r[9], control=control,
                        has_parents=r[10] is not None)
            for r in rows if r[0] is not None
        ]
        for job in jobs:
            self.gen_of[(job.id, job.attempt)] = gen
        if jobs:
            self._held_retry.reset()
            self._rate_retry.reset()
        for r in rows:
            # A limited claim held r[4] rows back.
            if r[0] is None and r[1] != WorkerStatements.FLOORS_MARKER:
                self._held_back_until(r[4], r[5])
        # RETURNING order is the update's, not the claim's: hand jobs out in claim order.
        jobs.sort(key=lambda j: (-j.priority, j.run_at, j.id))
        return jobs

    def _held_back_until(self, held: int, wait_ms: int | None) -> None:
        # A rate limit says how soon its next start is free, on the database's clock (this
        # worker's may run ahead of it or behind); a concurrency or key limit's slot frees
        # when a job ends, which only its worker's own next claim sees at once.
        self.held_back += held
        if wait_ms is not None:
            delay = max(wait_ms / 1000, self._rate_retry.next())
        else:
            delay = self._held_retry.next()
        self.wakeup.at(time.monotonic() + delay)

    def _choose(self, pick: Callable[[WorkerStatements], tuple[
                    tuple[Statement, Statement], tuple[Statement, Statement],
                    tuple[Statement, Statement], tuple[Statement, Statement]]],
                limit: int, outcomes: int = 0,
                ) -> tuple[Statement, dict[str, object], int | None, int | None]:
        """The claim to send: `pick` gives the (plain, limited, from floors, from floors
        reading the next floors) statements, of (one queue, several queues) each, of a
        statement set. Its statement, parameters, floors' token (None unless it claims from
        floors) and the generation it claims from (None: every partition, as limited claims
        do)."""
        params = self._claim_params(limit)
        which = 0 if self.single_queue else 1
        gen = self.gen if self._limits is None else None
        plain, limited, floored, peeking = pick(self._db.sql_of(gen, outcomes))
        if self.floors.ready():  # never with limits (listening())
            token, peek, lanes = self.floors.begin()
            params["lanes"] = lanes
            return (peeking if peek else floored)[which], params, token, gen
        return (plain if self._limits is None else limited)[which], params, None, gen

    async def claim(self, limit: int) -> list[Job]:
        async with self._own.connection() as conn:
            unknown = self.floors.unknown()
            if unknown:
                await self._discover(conn, unknown)
            query, params, token, gen = self._choose(lambda st: (
                (st.job_claim_one_queue, st.job_claim_many_queues),
                (st.job_claim_one_queue_limited, st.job_claim_many_queues_limited),
                (st.job_claim_one_queue_from_floors, st.job_claim_many_queues_from_floors),
                (st.job_claim_one_queue_from_floors_peek,
                 st.job_claim_many_queues_from_floors_peek)),
                limit)
            try:
                cur = self._own.cursor(conn)
                await cur.execute(query, params)
                rows = await cur.fetchall()
            except BaseException:
                if token is not None:
                    self.floors.abandon(token)
                raise
        return self._jobs(rows, token, gen)

    async def _discover(self, conn: psycopg.AsyncConnection[Any], queues: list[str]) -> None:
        token, _, _ = self.floors.begin()
        try:
            cur = await conn.execute(self._db.sql_of(self.gen).lanes_discover,
                                     {"queues": queues})
            rows = await cur.fetchall()
        except BaseException:
            self.floors.abandon(token)
            raise
        self.floors.discovered(token, rows, queues)

    # --- claims folded into the completer's flushes --------------------------------------

    def fold(self, plain: int = 0, gen: int | None = None) -> FoldedClaim | None:
        """A claim for the completer to add to its flush, its slots reserved until
        folded_claimed() or folded_failed(); None when nothing should be claimed now
        (stopping, or no free slot), or when the flush's outcomes are of jobs of another
        generation (`gen`) than the one this claim would read: one statement names one
        partition. `plain`: what the flush's outcomes are (sql/claim.py, PLAIN_OUTCOMES:
        done without results, or failed; DONE_OUTCOMES and LOCKED_DONE_OUTCOMES: done
        without results).
        """
        if self.stopping or self._suspect or self._narrow:
            return None
        if gen != (self.gen if self._limits is None else None):
            # Outcomes of another generation's jobs (a switch while they ran): until a flush
            # folds again, the fetcher claims on its own (_defer).
            self._fold_declined = True
            return None
        self._fold_declined = False
        limit = min(self._batch_size, self._free())
        if limit <= 0:
            return None
        self._reserved += limit
        # Lanes not known yet: this claim walks them from their start, the fetcher's own next
        # claim discovers them.
        query, params, token, claim_gen = self._choose(lambda st: (
            (st.job_set_outcome_if_running_many_then_claim_one_queue,
             st.job_set_outcome_if_running_many_then_claim_many_queues),
            (st.job_set_outcome_if_running_many_then_claim_one_queue_limited,
             st.job_set_outcome_if_running_many_then_claim_many_queues_limited),
            (st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors,
             st.job_set_outcome_if_running_many_then_claim_many_queues_from_floors),
            (st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors_peek,
             st.job_set_outcome_if_running_many_then_claim_many_queues_from_floors_peek)),
            limit, plain)
        return FoldedClaim(query, params, limit, token, claim_gen)

    def folded_claimed(self, rows: Sequence[Sequence[Any]], claim: FoldedClaim) -> None:
        jobs = self._jobs(rows, claim.token, claim.gen)
        self._reserved -= claim.reserved
        self.found_less = len(jobs) < claim.reserved
        self._hand_out(jobs)

    def _hand_out(self, jobs: list[Job]) -> None:
        # Told first: the on_claimed hook's task then starts before the handlers' (on_started).
        if jobs and self._claimed is not None:
            self._claimed(jobs)
        for job in jobs:
            self._dispatch(job)
        self.claimed += len(jobs)
        if self._lost:  # received at last: its lost replies are no longer in a row
            for job in jobs:
                self._lost.pop(job.id, None)

    def folded_failed(self, claim: FoldedClaim) -> None:
        self._reserved -= claim.reserved
        if claim.token is not None:
            self.floors.abandon(claim.token)
        self._suspect = True
        self._lost_limit = claim.reserved
        self.slot_freed.set()
        self.wakeup.set()

    @property
    def reserved(self) -> int:
        """Slots held for folded claims still in flight."""
        return self._reserved

    def _free(self) -> int:
        return self._free_slots() - self._reserved

    def _defer(self) -> bool:
        """Leave a short claim to the next flush: while claims come back full, the slots that
        handlers free are claimed by the flush of their outcomes (fold), in one statement
        with them, where a claim of its own would cost another statement and commit for a
        part of a batch."""
        return (not self.found_less and not self._suspect and not self._narrow
                and not self._fold_declined and self._folding())

    async def _claim_reserving(self, limit: int) -> list[Job]:
        # The slots stay reserved while the claim is in flight, as a folded claim's do: a flush
        # folding a claim meanwhile would otherwise count them as free too, and the worker
        # would run more handlers at once than its concurrency.
        if self._suspect:
            await self._release_lost_claims()
        self._reserved += limit
        try:
            jobs = await self.claim(limit)
        except BaseException:
            self._suspect = True
            self._lost_limit = limit
            raise
        finally:
            self._reserved -= limit
        if self._narrow:
            self._narrow -= 1
        return jobs

    async def _release_lost_claims(self, timeout: float | None = None) -> None:
        """Put back rows a lost claim reply left running under this worker, uncounted."""
        # No other claim may be in flight: its rows, committed but not yet handed out, would
        # look lost too. fold() claims nothing while a release is due.
        until = None if timeout is None else time.monotonic() + timeout
        while self._reserved:
            if until is not None and time.monotonic() > until:
                raise TimeoutError(f"a claim was still in flight after {timeout:g} s")
            await self.wakeup.wait(0.01)
        keep = self._keep()
        st = self._db.sql
        # Only a one-row claim's lost reply is that row's doing: rows of a lost batch are
        # released uncounted and claimed one at a time next.
        single = self._lost_limit == 1
        counted = ([i for i, n in self._lost.items() if n + 1 >= LOST_CLAIM_TIMES]
                   if single else [])
        async with self._own.connection() as conn:
            cur = await conn.execute(st.job_release_lost_claims, {
                "worker": self._worker_id, "ids": [i for i, _ in keep],
                "attempts": [a for _, a in keep], "channel": self._db.channel,
                "done": self._db.done_channel, "counted": counted, "times": LOST_CLAIM_TIMES})
            row = await cur.fetchone()
        self._suspect = False
        ids: list[int] = list(row[0]) if row else []
        for queue, priority, epoch in (row[2] if row else []):
            self.floors.lower(queue, [[priority, epoch]])
        if single or len(ids) == 1:  # a batch that held one row only: that row's too
            for i in ids:
                self._lost[i] = self._lost.pop(i, 0) + 1  # moved last: the oldest go first
            while len(self._lost) > LOST_CLAIM_MEMORY:
                del self._lost[next(iter(self._lost))]
        if ids:
            self._narrow = max(self._narrow, len(ids))
        gone = set(counted)
        uncounted = sum(1 for i in ids if i not in gone)
        if uncounted:
            self.released += uncounted
            log.warning("released %d job(s) claimed by a statement whose reply was lost with "
                        "its connection; their attempt is not counted", uncounted)
        if len(ids) > uncounted:
            log.warning("job(s) %s: the reply of their claim was lost %d times in a row; "
                        "released with the attempt counted (failed once attempts are spent)",
                        ", ".join(str(i) for i in ids if i in gone), LOST_CLAIM_TIMES)

    async def release_lost_claims_at_exit(self) -> None:
        """Shutdown: release what a lost claim reply left, if one may have; errors are logged
        (the reaper takes those rows after the lease instead)."""
        if not self._suspect:
            return
        try:
            await self._release_lost_claims(timeout=10.0)
        except (psycopg.Error, PoolTimeout, TimeoutError) as e:
            log.warning("could not release jobs of a claim whose reply was lost (%s); they "
                        "will be reaped after the lease", reason(e))

    async def run(self) -> None:
        async with self._own:
            await self._run()

    async def _run(self) -> None:
        retry = RetryPolicy(log, "claiming jobs")
        while not self.stopping:
            # Waiting on an asyncio event that is already set does not yield: without this, a
            # fetcher whose task group was cancelled (not stop()) could still send a claim, cut
            # off once sent, and leave its rows running under a worker gone until the lease.
            await anyio.lowlevel.checkpoint_if_cancelled()
            free = self._free()
            if free <= 0 or self._defer():
                await self.slot_freed.wait()
                self.slot_freed = asyncio.Event()
                continue
            limit = 1 if self._narrow else min(self._batch_size, free)
            try:
                jobs = await self._claim_reserving(limit)
                retry.succeeded()
            except RETRYABLE as e:
                # Any database error, not only a lost connection (a read-only server after a
                # failover, a revoked privilege, a statement_timeout): wait and claim again.
                # Only stop() cuts the wait short: notifications and failed folded claims
                # would otherwise retry at their pace, not the backoff's.
                until = time.monotonic() + retry.failed(e)
                while not self.stopping and time.monotonic() < until:
                    await self.wakeup.wait(until - time.monotonic())
                continue
            # Even when stop() came during the claim, these jobs are ours now: dispatch them so
            # that shutdown finishes or releases them like any other.
            self.found_less = len(jobs) < limit
            self._hand_out(jobs)
            if len(jobs) < limit and not self.stopping:
                await self.wakeup.wait(self._poll_interval)
