"""Where each claim starts: per (queue, priority) lane, a floor below which no row is queued.

A claim walks jobs_dequeue_idx over a lane from its start. Under a pinned xmin horizon (an idle
transaction, a long report) vacuum removes nothing, and the entries that claimed rows leave
behind pile up at that start: the claim read all of them, 1 block and 0.04 ms growing to 7,768
blocks and 36 ms in a minute at 2,000 jobs/s (benchmarks/results/SOAK.md). Claiming from a
floor reads only what was claimed since the last claim.

The floor is a (run_at, id) such that no row visible and queued in the lane lies below it:

- One claim in PEEK_EVERY reads, in its own snapshot, each lane's first queued row at or past
  its floor (sql/claim.py, the `_peek` statements; a plain read, so a row another claim holds
  but has not committed still counts), and that is the lane's next floor. None: the floor is
  +infinity. The other claims leave the floors as they are.
- A row can become queued below a floor only by a statement committed after that snapshot,
  and every such statement notifies its queue with each lane's earliest run_at (jobs_notify
  or the batch that names a partition for inserts, notify_lanes for requeues): the
  notification lowers the floor, to 1 ms under that run_at (the epoch travels as a float).
  A notification handled after a claim was sent may concern a commit the claim's snapshot
  missed, so it is applied again over the floor the claim brings back (`pending` below).
- Notifications are only heard while the LISTEN connection is up: when it connects again
  (some may have been lost) every floor is forgotten, and the next claim first walks each
  queue's lanes from their start (sql/claim.py, `lanes_discover`). So does one in
  REDISCOVER_EVERY seconds, for rows put back to queued by hand without a notification.

A lower floor than necessary only costs reads; a higher one would hide a job, which is what
the rules above exclude.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from .._checks import compact_json

# A floor of +infinity: nothing queued in the lane at or past the old floor.
TOP = (datetime.max.replace(tzinfo=UTC), 0)
BOTTOM = (datetime.min.replace(tzinfo=UTC), 0)
# A notification's run_at is an epoch in a float (microseconds may round either way).
MARGIN = timedelta(milliseconds=1)
# Lanes are walked from their start again this often: a row requeued by hand (an UPDATE in
# psql) sends no notification; it is claimed within this long.
REDISCOVER_EVERY = 300.0
# A claim reads its lanes' next floors one time in this many: reading them costs each claim
# an index scan per lane; a floor left behind meanwhile costs the next claims the entries of
# the few batches claimed since.
PEEK_EVERY = 4

Floor = tuple[datetime, int]


class Floors:
    def __init__(self, queues: Sequence[str], *, enabled: bool = True) -> None:
        self._queues = set(queues)
        # queue -> priority -> floor, for the queues whose lanes are known.
        self._lanes: dict[str, dict[int, Floor]] = {}
        # Without LISTEN no notification lowers a floor: every claim walks from the start.
        self.enabled = enabled
        self._serial = itertools.count(1)
        self._last = 0  # the serial of the latest lowering
        self._in_flight: dict[int, int] = {}  # claim token -> _last when its params were read
        # Lowerings heard while claims were in flight: (serial, queue, priority, floor).
        self._pending: list[tuple[int, str, int | None, Floor]] = []
        self._discovered_at = 0.0

    # --- what the next claim needs ---------------------------------------------------------

    def unknown(self) -> list[str]:
        """Queues whose lanes must be discovered before a claim can start from floors."""
        if not self.enabled:
            return []
        if time.monotonic() - self._discovered_at > REDISCOVER_EVERY:
            self._lanes.clear()
            self._distrust_in_flight()
        return [q for q in sorted(self._queues) if q not in self._lanes]

    def ready(self) -> bool:
        return self.enabled and not self.unknown()

    def floor(self, queue: str, priority: int) -> Floor | None:
        """The lane's floor; None when the lane is not known."""
        return self._lanes.get(queue, {}).get(priority)

    def begin(self) -> tuple[int, bool, str]:
        """A claim is about to be sent: its token, whether it reads the next floors (the
        `_peek` statements), and its `lanes` parameter (priority order)."""
        token = next(self._serial)
        self._in_flight[token] = self._last
        lanes = sorted(((q, p, f) for q, ps in self._lanes.items() for p, f in ps.items()),
                       key=lambda x: -x[1])
        # A floor at the bottom goes as null, which the claim reads as -infinity.
        return token, token % PEEK_EVERY == 0, compact_json(
            [[q, p, None if f[0] <= BOTTOM[0] else f[0].isoformat(), f[1]]
             for q, p, f in lanes])

    def abandon(self, token: int) -> None:
        """The claim failed: what it would have told is unknown, the floors stay as they are."""
        self._in_flight.pop(token, None)
        self._prune()

    def settle(self, token: int, peeks: Iterable[Sequence[Any]]) -> None:
        """The claim's floors came back: [queue, priority, run_at or None, id or None] each."""
        since = self._in_flight.pop(token, self._last)
        if since < 0:
            self._prune()
            return  # read before notifications were lost: its floors may hide what they told
        for q, p, at, i in peeks:
            lanes = self._lanes.get(q)
            if lanes is None or p not in lanes:
                continue  # forgotten meanwhile (a reconnect): rediscovered before use
            lanes[p] = TOP if at is None else (_timestamp(at), int(i))
        self._reapply(since)
        self._prune()

    def discovered(self, token: int, rows: Iterable[Sequence[Any]], queues: Sequence[str]) -> None:
        """lanes_discover's rows (queue, priority, run_at, id) for `queues`."""
        since = self._in_flight.pop(token, self._last)
        if since < 0:
            self._prune()
            return  # read before notifications were lost: discovered again before use
        found: dict[str, dict[int, Floor]] = {q: {} for q in queues}
        for q, p, at, i in rows:
            found[q][int(p)] = (_timestamp(at), int(i))
        self._lanes.update(found)
        if not self._discovered_at or set(queues) >= self._queues:
            self._discovered_at = time.monotonic()
        self._reapply(since)
        self._prune()

    # --- what notifications tell -----------------------------------------------------------

    def forget(self) -> None:
        """The LISTEN connection (re)connected, or went down: notifications may be lost."""
        self._lanes.clear()
        self._pending.clear()
        self._last = next(self._serial)
        self._distrust_in_flight()

    def _distrust_in_flight(self) -> None:
        for token in self._in_flight:
            self._in_flight[token] = -1  # a claim in flight now brings back nothing usable

    def lower(self, queue: str, lanes: Sequence[Sequence[Any]] | None) -> None:
        """A notification for `queue`: lanes [[priority, run_at epoch], ...], or None when it
        did not say (a hand-made NOTIFY, an older version's statement): rediscover."""
        if queue not in self._queues:
            return
        serial = self._last = next(self._serial)
        if lanes is None:
            self._lanes.pop(queue, None)
            if self._in_flight:
                self._pending.append((serial, queue, None, BOTTOM))
            return
        for priority, epoch in lanes:
            floor = _floor_under(float(epoch))
            self._lower(queue, int(priority), floor)
            if self._in_flight:
                self._pending.append((serial, queue, int(priority), floor))

    def _lower(self, queue: str, priority: int | None, floor: Floor) -> None:
        lanes = self._lanes.get(queue)
        if lanes is None:
            return  # unknown: its discovery reads every lane
        if priority is None:
            del self._lanes[queue]
            return
        old = lanes.get(priority)
        if old is None or floor < old:
            lanes[priority] = floor

    def _reapply(self, since: int) -> None:
        # Lowerings heard after the claim's parameters were read may concern commits its
        # snapshot did not see: they hold over the floors it brought back. since == -1: the
        # connection was lost meanwhile, and forget() already cleared every floor.
        for serial, queue, priority, floor in self._pending:
            if serial > since:
                self._lower(queue, priority, floor)

    def _prune(self) -> None:
        if not self._in_flight:
            self._pending.clear()
            return
        oldest = min(self._in_flight.values())
        self._pending = [e for e in self._pending if e[0] > oldest]


def _floor_under(epoch: float) -> Floor:
    # Just under a notified run_at; one out of datetime's range (a run_at of +-infinity, or
    # centuries away) lowers the floor to the bottom, which the claims read as -infinity.
    try:
        return (datetime.fromtimestamp(epoch, UTC) - MARGIN, 0)
    except (OverflowError, ValueError, OSError):
        return BOTTOM


def _timestamp(value: Any) -> datetime:
    # From jsonb (the claims' marker row) an ISO string, or what no datetime holds: "-infinity"
    # or a year BC (the bottom, sent back as -infinity), "infinity" or a year past 9999 (the
    # top: only a row due after 9999 is above it).
    if isinstance(value, datetime):
        return value
    text = str(value)
    if text == "-infinity" or text.endswith(" BC"):
        return BOTTOM[0]
    try:
        return datetime.fromisoformat(text)
    except ValueError:  # "infinity", a year past 9999
        return TOP[0]
