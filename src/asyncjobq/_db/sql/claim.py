"""The worker's statements: claim, complete (and claim again), heartbeat, release; and the
claim as `doctor` prepares and explains it, which must stay the statement workers run."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

from psycopg import sql

from .common import (
    CLAIM_COLUMNS,
    HORIZON_HOLDERS,
    Role,
    Statement,
    _q,
    count_history,
    history_row,
    notify_lanes,
    notify_waited,
)

# Not ended by this statement: a running row r of this worker whose attempt a completion
# folded into the same statement finishes no longer runs (flow_out; for a key, `final` ones
# only: a retried job keeps its key).
_NOT_ENDED_HERE = (
    "NOT (r.locked_by = %(worker)s AND EXISTS (SELECT FROM flow_out f,"
    " unnest(f.ids, f.attempts, f.final) AS o(id, attempt, final)"
    " WHERE o.id = r.id AND o.attempt = r.attempts{final}))")

# The limited claim's scan (alias j): a row of a limited task is left out when its snapshot
# shows the task full (flow_sat) or the row past its key's free slots. Only a filter: what
# starts is flow_admit's decision (0007_flow_control.sql).
_FLOW_FILTER = (
    "    AND (NOT %(limits)s::jsonb ? j.task OR ("
    "     j.task <> ALL((SELECT tasks FROM flow_sat)::text[])"
    "     AND (j.key IS NULL OR j.attempts > 0 OR NOT (%(limits)s::jsonb -> j.task) ? 'k'"
    "      OR j.id = ANY(ARRAY(SELECT e.id FROM {s}.jobs e"
    "       WHERE e.task = j.task AND e.key = j.key AND e.status = 'queued'"
    "         AND e.attempts = 0 AND e.run_at <= now()"
    "       ORDER BY e.priority DESC, e.run_at, e.id"
    "       LIMIT greatest(0, (%(limits)s::jsonb -> j.task ->> 'k')::bigint"
    "         - (SELECT count(*) FROM {s}.jobs r"
    "            WHERE r.task = j.task AND r.key = j.key AND r.status = 'running' AND r.flow"
    "              AND " + _NOT_ENDED_HERE.format(final=" AND o.final") + ")"
    "         - (SELECT count(*) FROM {s}.jobs q WHERE q.task = j.task AND q.key = j.key"
    "            AND q.status = 'queued' AND q.attempts > 0)))))))"
)
# Rows a limited claim's scan examines per priority at most: past a backlog this long of
# rows it must step over (a full task, busy keys), it claims nothing and waits.
_FLOW_SCAN = 1000


# Floors are Python datetimes in the worker, years 1 to 9999 only, while run_at may be
# +-infinity (set by hand) or centuries away. A floor at the bottom goes out as NULL, read as
# -infinity; the peek's run_ats come back as jsonb text, which the worker maps (floors.py);
# discovery's, as a column, come back clamped to that range (a floor held under 9999 only
# hides jobs due after it).
_FLOOR_AT = "coalesce(l.at, '-infinity')"
_CLAMPED = ("CASE WHEN {0} IS NOT NULL THEN least(greatest({0}, '0001-01-01 00:00:00+00'),"
            " '9999-12-31 00:00:00+00') END")


# The outcomes (rows of `mine`) that move their job to history: done, cancelled, and a retry
# or snooze of a job whose cancel was asked for (it is cancelled, not run again). The rest are
# updated in place; every row of `mine` is one or the other, never both (a statement must not
# modify a row twice).
_ARCHIVED = "kind IN ('done', 'cancelled') OR (kind IN ('retry', 'snooze') AND cancel)"

# What a flush's outcomes are (Statements.outcomes): any kind; done without a result or
# failed (the history row needs no join with the outcomes); done without a result only (no
# row stays in jobs: no UPDATE, no notification of requeued rows in the statement); the same
# with the rows locked first, for a connection without the workers' plan settings
# (WorkerStatements._DONE_ROWS).
ANY_OUTCOMES, PLAIN_OUTCOMES, DONE_OUTCOMES, LOCKED_DONE_OUTCOMES = 0, 1, 2, 3
_DONE_SHAPES = (DONE_OUTCOMES, LOCKED_DONE_OUTCOMES)


class WorkerStatements(Role):

    def _job_claim_update(self, next_due: str) -> str:
        # One statement: lock the next due rows (skipping rows other workers hold) and mark
        # them running. FOR NO KEY UPDATE does not block foreign-key inserts into child tables.
        # = ANY(ARRAY(...)), not IN (...): a generic plan knows neither the queue nor the limit
        # and guesses that IN returns a tenth of the table, then hash-joins it against a
        # sequential scan; an array's ids are looked up by primary key whatever its size.
        return (
            "UPDATE {s}.{j} SET status = 'running', locked_by = %(worker)s,"
            "   locked_at = now(), attempts = attempts + 1"
            f" WHERE id = ANY(ARRAY({next_due}))"
            " RETURNING {c}"
        )


    @staticmethod
    def _next_due_of_queue(queue: str, limited: bool = False) -> str:
        # The next due rows of one queue, in claim order, a priority at a time: the recursive
        # part steps down jobs_dequeue_idx from one priority to the next (one index descent
        # each), and each priority's due rows are a range of the index, since run_at follows
        # priority in it. One scan over all priorities with run_at <= now() as a filter
        # walked every not-yet-due job of every priority it passed (15 ms a claim with
        # 200,000 jobs delayed and none due). PostgreSQL evaluates the recursion only as far
        # as the LIMIT pulls, so a claim that fills up in the first priority never descends
        # further, and only rows it returns are locked. The rows come out in claim order by
        # construction (priorities descending, a nested loop over them), not by a sort.
        # A paused queue (0006_paused_queues.sql) yields no first priority, so nothing: the
        # probe depends on the queue alone, evaluated once per queue, not once per row.
        return (
            "WITH RECURSIVE p AS ("
            "  (SELECT priority FROM {s}.{j}"
            f"   WHERE queue = {queue} AND status = 'queued'"
            "     AND NOT EXISTS (SELECT FROM {s}.paused_queues pq"
            f"       WHERE pq.queue = {queue})"
            "   ORDER BY priority DESC LIMIT 1)"
            "  UNION ALL"
            "  SELECT (SELECT j.priority FROM {s}.{j} j"
            f"   WHERE j.queue = {queue} AND j.status = 'queued' AND j.priority < p.priority"
            "   ORDER BY j.priority DESC LIMIT 1)"
            "  FROM p WHERE p.priority IS NOT NULL)"
            " SELECT n.id, n.priority, n.run_at FROM p CROSS JOIN LATERAL ("
            + (
                # The scan stops at the _FLOW_SCAN-th due row of the priority (b), found by
                # an index-only walk: rows it steps over cost a filter each, and a backlog of
                # held rows would otherwise be walked whole by every claim.
                "  SELECT * FROM ((SELECT run_at AS b_run_at, id AS b_id FROM {s}.jobs"
                f"   WHERE queue = {queue} AND status = 'queued' AND priority = p.priority"
                f"     AND run_at <= now() ORDER BY run_at, id OFFSET {_FLOW_SCAN - 1} LIMIT 1)"
                "  UNION ALL (SELECT 'infinity'::timestamptz, 9223372036854775807::bigint))"
                "  AS u LIMIT 1) b"
                " CROSS JOIN LATERAL ("
                "  SELECT j.id, j.priority, j.run_at FROM {s}.jobs j"
                f"  WHERE j.queue = {queue} AND j.status = 'queued' AND j.priority = p.priority"
                "    AND j.run_at <= now() AND (j.run_at, j.id) <= (b.b_run_at, b.b_id)"
                + _FLOW_FILTER +
                "  ORDER BY j.run_at, j.id LIMIT %(limit)s"
                "  FOR NO KEY UPDATE OF j SKIP LOCKED) n"
                if limited else
                "  SELECT id, priority, run_at FROM {s}.{j}"
                f"  WHERE queue = {queue} AND status = 'queued' AND priority = p.priority"
                "    AND run_at <= now()"
                "  ORDER BY run_at, id LIMIT %(limit)s"
                "  FOR NO KEY UPDATE SKIP LOCKED) n"
            ) +
            " LIMIT %(limit)s"
        )

    def _next_due_one_queue(self, limited: bool = False) -> str:
        return "SELECT id FROM (" + self._next_due_of_queue("%(queue)s", limited) + ") d"

    # Several queues: each queue's next rows, then the first of those. One scan with
    # queue = ANY(...) cannot read the index in claim order, so it sorted every due job of the
    # queues on every claim (260 ms a claim with 1,000,000 queued). The price: each queue's
    # next `limit` rows are locked, up to (queues - 1) x limit more than are claimed. They stay
    # queued, and other workers' claims skip them until this statement commits; with a
    # backlog those claims take the rows after them, but when a few jobs are all that is due,
    # another worker can come back short and wait for its next wake-up, while this one claims
    # the rest with its next batch.
    def _next_due_many_queues(self, limited: bool = False) -> str:
        return (
            "SELECT c.id FROM unnest(%(queues)s::text[]) AS q(name)"
            " CROSS JOIN LATERAL (" + self._next_due_of_queue("q.name", limited) + ") c"
            " ORDER BY c.priority DESC, c.run_at, c.id LIMIT %(limit)s")

    @cached_property
    def job_claim_one_queue(self) -> Statement:
        return self._compose(self._job_claim_update(self._next_due_one_queue()))

    @cached_property
    def job_claim_many_queues(self) -> Statement:
        return self._compose(self._job_claim_update(self._next_due_many_queues()))

    # --- claims from floors (docs/how-it-works/storage.md) -----------------------------------
    # Under a pinned xmin horizon nothing can remove the index entries that claimed rows leave
    # behind in jobs_dequeue_idx, and a scan from the start of a (queue, priority) lane reads
    # every one of them. The worker keeps, per lane, a floor: a (run_at, id) below which its
    # last claim saw no queued row (_worker/floors.py), and these claims start there. One in
    # a few also reads each lane's first queued row at or past its floor (`peek`, a plain read: a
    # row another claim has locked but not committed is still queued to it, and counts), the
    # lane's next floor. A row that becomes queued below a floor afterwards is written by a
    # statement that notifies the queue with its lanes' earliest run_at (jobs_notify, a batch
    # into a partition, every statement that requeues), and the notification lowers it.
    # Parameter %(lanes)s: [[queue, priority, floor run_at, floor id], ...] in priority order
    # (highest first), one JSON text as the outcomes are (an encoder call, not four arrays').
    _LANES = (
        "lanes AS MATERIALIZED (SELECT e->>0 AS queue, (e->>1)::int AS priority,"
        " (e->>2)::timestamptz AS at, (e->>3)::bigint AS id, ord"
        " FROM jsonb_array_elements(%(lanes)s::jsonb) WITH ORDINALITY AS l(e, ord))")

    @staticmethod
    def _next_due_from_floors(one_queue: bool) -> str:
        # A lane's due rows are one range of jobs_dequeue_idx from its floor on. For one queue
        # the lanes come in priority order and are read in turn as far as the LIMIT pulls (a
        # nested loop: no sort, and only rows it returns are locked); several queues' lanes
        # are merged by claim order, as _next_due_many_queues does.
        lane = (
            "SELECT j.id, j.priority, j.run_at FROM {s}.{j} j"
            " WHERE j.queue = l.queue AND j.status = 'queued' AND j.priority = l.priority"
            "   AND (j.run_at, j.id) >= (" + _FLOOR_AT + ", l.id) AND j.run_at <= now()"
            "   AND NOT EXISTS (SELECT FROM {s}.paused_queues pq WHERE pq.queue = l.queue)"
            " ORDER BY j.run_at, j.id LIMIT %(limit)s FOR NO KEY UPDATE OF j SKIP LOCKED")
        if one_queue:
            return ("SELECT n.id FROM (SELECT * FROM lanes ORDER BY ord) l"
                    f" CROSS JOIN LATERAL ({lane}) n LIMIT %(limit)s")
        return ("SELECT n.id FROM lanes l CROSS JOIN LATERAL (" + lane + ") n"
                " ORDER BY n.priority DESC, n.run_at, n.id LIMIT %(limit)s")

    # Each lane's first queued row at or past its floor that this statement does not claim
    # (the statement's snapshot still shows those queued), due or not: NULL when none. Only
    # the `_peek` statements read it, which the worker sends one claim in a few (floors.py,
    # PEEK_EVERY); a floor left where it was is only lower than it could be. The others leave
    # the CTE out rather than skip it on a parameter: a generic plan still sets up every node
    # of a skipped one, 7 us a job of the flush's server time (measured in one backend).
    _PEEK = (
        "peek AS (SELECT l.queue, l.priority, f.run_at, f.id FROM lanes l LEFT JOIN LATERAL ("
        " SELECT j.run_at, j.id FROM {s}.{j} j"
        " WHERE j.queue = l.queue AND j.status = 'queued' AND j.priority = l.priority"
        "   AND (j.run_at, j.id) >= (" + _FLOOR_AT + ", l.id)"
        "   AND NOT EXISTS (SELECT FROM claimed c WHERE c.id = j.id)"
        " ORDER BY j.run_at, j.id LIMIT 1) f ON true)")
    # The floors come back as one marker row (id NULL, task 'floors'), typed as CLAIM_COLUMNS
    # are, with [[queue, priority, run_at, id], ...] in the payload column.
    FLOORS_MARKER = "floors"
    _FLOORS_ROW = (
        "SELECT NULL::bigint, '" + FLOORS_MARKER + "'::text, NULL::text,"
        " (SELECT coalesce(jsonb_agg(jsonb_build_array(queue, priority, run_at, id)), '[]')"
        "  FROM peek), NULL::int, NULL::int, NULL::int, NULL::timestamptz,"
        " NULL::timestamptz, NULL::jsonb, NULL::int")

    def _job_claim_from_floors(self, one_queue: bool, peek: bool) -> Statement:
        claim = ("WITH " + self._LANES + ", claimed AS ("
                 + self._job_claim_update(self._next_due_from_floors(one_queue)) + ")")
        if not peek:
            return self._compose(claim + " SELECT {c} FROM claimed")
        return self._compose(claim + ", " + self._PEEK + " SELECT {c} FROM claimed"
                             " UNION ALL " + self._FLOORS_ROW)

    @cached_property
    def job_claim_one_queue_from_floors(self) -> Statement:
        return self._job_claim_from_floors(one_queue=True, peek=False)

    @cached_property
    def job_claim_many_queues_from_floors(self) -> Statement:
        return self._job_claim_from_floors(one_queue=False, peek=False)

    @cached_property
    def job_claim_one_queue_from_floors_peek(self) -> Statement:
        return self._job_claim_from_floors(one_queue=True, peek=True)

    @cached_property
    def job_claim_many_queues_from_floors_peek(self) -> Statement:
        return self._job_claim_from_floors(one_queue=False, peek=True)

    @cached_property
    def generation_current(self) -> Statement:
        # The generation of jobs whose partition inserts go to and claims read
        # (0013_generations.sql).
        return _q("SELECT gen FROM {s}.generation", self.schema)

    @cached_property
    def horizon_held(self) -> Statement:
        # Whether a session has held the xmin horizon for longer than %(seconds)s: every
        # claimed row's dead index entry then stays (fetcher.py, watch_horizon).
        return self._compose(
            "SELECT EXISTS (SELECT FROM (" + HORIZON_HOLDERS + ") h"
            " WHERE h.since < now() - make_interval(secs => %(seconds)s))")

    @cached_property
    def lanes_discover(self) -> Statement:
        # A worker that knows no floors for %(queues)s (it started, or its LISTEN connection
        # was down and notifications may be lost): each queue's lanes, by a walk of
        # jobs_dequeue_idx from each priority's start, and each lane's first queued row. Only
        # this statement reads every entry a pinned horizon left; the claims that follow
        # start from its floors.
        return self._compose(
            "SELECT q.name, p.priority, " + _CLAMPED.format("f.run_at") + " AS run_at, f.id"
            " FROM unnest(%(queues)s::text[]) AS q(name)"
            " CROSS JOIN LATERAL (WITH RECURSIVE p AS ("
            "  (SELECT priority FROM {s}.{j} WHERE queue = q.name AND status = 'queued'"
            "   ORDER BY priority DESC LIMIT 1)"
            "  UNION ALL"
            "  SELECT (SELECT j.priority FROM {s}.{j} j"
            "   WHERE j.queue = q.name AND j.status = 'queued' AND j.priority < p.priority"
            "   ORDER BY j.priority DESC LIMIT 1)"
            "  FROM p WHERE p.priority IS NOT NULL)"
            "  SELECT priority FROM p WHERE priority IS NOT NULL) p"
            " CROSS JOIN LATERAL (SELECT j.run_at, j.id FROM {s}.{j} j"
            "  WHERE j.queue = q.name AND j.status = 'queued' AND j.priority = p.priority"
            "  ORDER BY j.run_at, j.id LIMIT 1) f")

    # --- claims of a worker that has limited tasks (0007_flow_control.sql) ------------------
    # The same claim, plus %(limits)s ({task: {"c": n, "k": n, "r": [n, seconds]}}, the
    # limited tasks declared on the worker's queues). Its scan leaves out rows its snapshot
    # shows over a limit (so that a busy key or a full task does not fill the batch with rows
    # that cannot start), then flow_admit decides, under locks and on fresh snapshots, which of
    # the locked rows start. A worker without limited tasks on its queues runs the statements
    # above, unchanged. Besides the claimed rows, one marker row (id NULL) says how many rows
    # were held back (in the `priority` column) and in how many milliseconds the first
    # rate-limited one may start (`attempts`).

    @staticmethod
    def _job_claim_limited(next_due: str, outgoing: str,
                           queue_of: Callable[[str], str]) -> str:
        # queue_of("e"): the condition that row e is in a queue this claim serves.
        return (
            "flow_out AS (SELECT " + outgoing + "),"
            # Tasks over a limit in this snapshot, and when the first full rate window frees.
            " flow_sat AS MATERIALIZED ("
            "  SELECT coalesce(array_agg(l.task) FILTER (WHERE x.cf OR x.rf), '{{}}') AS tasks,"
            "   min(x.free_at) FILTER (WHERE x.rf) AS retry_at"
            "  FROM jsonb_each(%(limits)s::jsonb) AS l(task, v)"
            "  CROSS JOIN LATERAL (SELECT"
            "   v ? 'c' AND (SELECT count(*) FROM {s}.jobs r"
            "    WHERE r.task = l.task AND r.status = 'running' AND r.flow"
            "      AND " + _NOT_ENDED_HERE.format(final="") + ") >= (v ->> 'c')::bigint AS cf,"
            "   st.n >= (v -> 'r' ->> 0)::bigint AS rf,"
            "   st.oldest + make_interval(secs => (v -> 'r' ->> 1)::float8 + 0.05) AS free_at"
            "   FROM (SELECT count(*) AS n, min(s.started_at) AS oldest FROM {s}.flow_starts s"
            "    WHERE v ? 'r' AND s.task = l.task AND s.started_at > clock_timestamp()"
            "      - make_interval(secs => (v -> 'r' ->> 1)::float8 + 0.05)) st) x),"
            # The next job of each key this statement's completions end comes first: a key's
            # jobs then follow one another in the worker that ran the last one, in the flush
            # that ends it, where another worker would only find it at its next claim.
            " flow_next AS ("
            "  SELECT h.id FROM (SELECT DISTINCT f.task, f.key FROM {s}.jobs f, flow_out fo,"
            "    unnest(fo.ids, fo.final) AS o(id, final)"
            "    WHERE f.id = o.id AND o.final AND f.key IS NOT NULL"
            "      AND (%(limits)s::jsonb -> f.task) ? 'k') k"
            "  CROSS JOIN LATERAL (SELECT e.id FROM {s}.jobs e"
            "    WHERE e.task = k.task AND e.key = k.key AND e.status = 'queued'"
            "      AND e.run_at <= now() AND " + queue_of("e") +
            "    ORDER BY e.priority DESC, e.run_at, e.id LIMIT 1"
            "    FOR NO KEY UPDATE SKIP LOCKED) h),"
            # next_due in parentheses: the several queues' scan ends in its own ORDER BY and
            # LIMIT, which would otherwise apply to the union.
            " flow_cand AS MATERIALIZED (SELECT ARRAY("
            "  SELECT id FROM (SELECT id FROM flow_next UNION ALL (" + next_due + ")) c"
            "  LIMIT %(limit)s) AS ids),"
            # flow_admit only when a candidate has a limit: jobs without one start as they
            # would from the plain claim, without the function's call and locks.
            " flow_lim AS MATERIALIZED (SELECT EXISTS (SELECT FROM {s}.jobs x, flow_cand"
            "  WHERE x.id = ANY(flow_cand.ids) AND %(limits)s::jsonb ? x.task) AS found),"
            " flow_adm AS MATERIALIZED ("
            "  SELECT a.* FROM flow_cand, {s}.flow_admit(flow_cand.ids, %(limits)s::jsonb,"
            "    (SELECT ids FROM flow_out), (SELECT attempts FROM flow_out),"
            "    (SELECT final FROM flow_out), %(worker)s) AS a"
            "   WHERE (SELECT found FROM flow_lim)"
            "  UNION ALL SELECT ids, 0, NULL::timestamptz FROM flow_cand"
            "   WHERE NOT (SELECT found FROM flow_lim)),"
            " claimed AS ("
            "  UPDATE {s}.jobs SET status = 'running', locked_by = %(worker)s,"
            "   locked_at = now(), attempts = attempts + 1, flow = %(limits)s::jsonb ? task"
            "  WHERE id = ANY((SELECT admitted FROM flow_adm)::bigint[])"
            "  RETURNING {c})"
        )

    @staticmethod
    def _held_marker(queue_of: Callable[[str], str]) -> str:
        # Also when nothing was held but the claim came back short while due jobs of limited
        # tasks wait: its scan left them out (a busy key, a full task), and no notification
        # will say when they may start. Typed as CLAIM_COLUMNS are: a subquery's bare NULLs
        # would be text. The wait until the first full rate window frees comes as
        # milliseconds (the `attempts` column), reckoned on the clock the window was counted
        # on: a worker that subtracted its own clock from the window's end woke early by as
        # much as it ran ahead, and claimed again and again until the window freed.
        return (
            "SELECT NULL::bigint, NULL::text, NULL::text, NULL::jsonb, held,"
            " ceil(extract(epoch FROM least(retry_at, (SELECT retry_at FROM flow_sat))"
            "  - clock_timestamp()) * 1000)::int,"
            " NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::jsonb, NULL::int"
            # Not an EXISTS over the queue's waiting rows: across priorities no index bounds
            # run_at <= now(), and it walked every delayed row. A short claim with a task full
            # in this snapshot, or with keyed tasks, may have stepped over rows; the fetcher
            # backs off while that stays so (fetcher.py).
            " FROM flow_adm WHERE held > 0 OR (cardinality(admitted) < %(limit)s"
            "  AND ((SELECT cardinality(tasks) > 0 FROM flow_sat)"
            "   OR EXISTS (SELECT FROM jsonb_each(%(limits)s::jsonb) AS l(task, v)"
            "    WHERE v ? 'k')))")

    @staticmethod
    def _in_one_queue(alias: str) -> str:
        return (f"{alias}.queue = %(queue)s AND NOT EXISTS (SELECT FROM {{s}}.paused_queues pq"
                f" WHERE pq.queue = {alias}.queue)")

    @staticmethod
    def _in_many_queues(alias: str) -> str:
        return (f"{alias}.queue = ANY(%(queues)s::text[]) AND NOT EXISTS (SELECT FROM"
                f" {{s}}.paused_queues pq WHERE pq.queue = {alias}.queue)")

    def _job_claim_limited_alone(self, next_due: str,
                                 queue_of: Callable[[str], str]) -> Statement:
        return self._compose(
            "WITH " + self._job_claim_limited(
                next_due, "'{{}}'::bigint[] AS ids, '{{}}'::int[] AS attempts,"
                " '{{}}'::boolean[] AS final", queue_of)
            + " SELECT {c} FROM claimed UNION ALL " + self._held_marker(queue_of))

    @cached_property
    def job_claim_one_queue_limited(self) -> Statement:
        return self._job_claim_limited_alone(self._next_due_one_queue(limited=True),
                                             self._in_one_queue)

    @cached_property
    def job_claim_many_queues_limited(self) -> Statement:
        return self._job_claim_limited_alone(self._next_due_many_queues(limited=True),
                                             self._in_many_queues)

    # Writing outcomes, one statement per flush for every outcome kind. Each row is fenced on
    # (status, locked_by, attempts): a worker presumed dead cannot overwrite a newer attempt.
    # `done` rows move to jobs_history; the rest are updated in place. The accepted ids come
    # back from `archived` and `updated`; the caller logs the refused ones. A flush of done
    # outcomes alone has no `updated` (DONE_OUTCOMES): its UPDATE, whose executor set-up and
    # row triggers every flush paid, would find no row.
    _OUTCOME_TEMPLATE = (
        # One JSON parameter, [[id, attempt, kind, delay, error], ...]: one encoder call in
        # the worker, where five arrays cost psycopg's per-element array dumping.
        # `status::text = 'running'` here, in the heartbeat and in the move of a misplaced
        # job: the rows are found by primary key only. Written `status = 'running'`, the
        # condition matches jobs_running_idx's predicate, and the planner ANDed a bitmap of
        # that whole index in: under a pinned xmin horizon it holds an entry for every row
        # that ever ran (68,630 after 35 s at 2,000 jobs/s; 10 ms a flush).
        # A sixth element, the handler's result, only when it returned one (a `done`).
        "o AS ("
        "  SELECT (e->>0)::bigint AS id, (e->>1)::int AS attempt, e->>2 AS kind,"
        "    (e->>3)::float8 AS delay, e->>4 AS error, e->5 AS result"
        "  FROM jsonb_array_elements(%(outcomes)s::jsonb) AS e),"
        "{fence}"
        " finished AS ("
        "  DELETE FROM {s}.{j} j{arch}"
        "    AND j.status::text = 'running' AND j.locked_by = %(worker)s"
        # Jobs made final that a Queue.wait looks for: their ids to <schema>_done.
        "  RETURNING j.*, CASE WHEN j.waited THEN pg_notify(%(done)s, j.id::text) END),"
        " archived AS ({archived}),"
        " counted AS (" + count_history("archived") + ")"
    )
    # Lock the rows in id order first, as the heartbeat does: two statements that lock
    # overlapping rows in different orders deadlock (seen in the soak benchmark). Rows are
    # found by primary key (= ANY(ARRAY(...))): a join lets the planner walk every running
    # row of the table once per outcome, which made a flush of 50 cost milliseconds.
    # `cancel`: Queue.cancel asked for the job to stop. Read here, from the locked rows,
    # which are the newest versions: a cancel that committed after this statement's
    # snapshot is seen (the other CTEs' scans see the snapshot's).
    _LOCKED = (
        " locked AS MATERIALIZED ("
        "  SELECT j.id, j.attempts, j.cancel_requested_at IS NOT NULL AS cancel"
        "  FROM {s}.{j} j"
        "  WHERE j.id = ANY(ARRAY(SELECT id FROM o))"
        "    AND j.status::text = 'running' AND j.locked_by = %(worker)s"
        "  ORDER BY j.id FOR UPDATE OF j),"
        # `arch`: the outcome moves its job to history (_ARCHIVED); the others update it.
        # Done and cancelled (a cancel the worker heard of) rows move to history, with the
        # result, and the error for a cancelled one. So does a retry or snooze of a job whose
        # cancel was asked for after its handler ended: it is cancelled, not run again.
        " mine AS MATERIALIZED ("
        "  SELECT o.*, " + _ARCHIVED + " AS arch"
        "  FROM o JOIN locked l ON l.id = o.id AND l.attempts = o.attempt),"
    )
    # A flush of done outcomes alone (DONE_OUTCOMES) into one partition has no `locked` or
    # `mine`: every row moves to history whatever its cancel, so the DELETE is fenced on the
    # attempt itself (a hashed subplan: `IS TRUE` keeps the planner from making it a join
    # that reads `o` once per row). It locks its rows in id order all the same: a plain index
    # scan of the partition's primary key on `= ANY(...)` walks the array sorted, and workers
    # plan no sequential or bitmap scan (_worker_plan_settings; tests/test_worker.py reads
    # the plan). Where those settings are not in force (a pooled connection, a transaction
    # pooler) the completer sends its done outcomes as LOCKED_DONE_OUTCOMES, which lock
    # first (Completer._write). The two CTEs cost ~4 us of server CPU a job at batch 10: a lock
    # and a second write of each row, and their nodes' set-up at every execution
    # (docs/how-it-works/fencing.md).
    _DONE_ROWS = ("  WHERE j.id = ANY(ARRAY(SELECT id FROM o))"
                  "    AND ((j.id, j.attempts) IN (SELECT id, attempt FROM o)) IS TRUE")

    # The rows that stay in jobs (retried, snoozed, failed): updated in place, and the queued
    # ones announced. Left out of the flush of a batch of done outcomes (DONE_OUTCOMES).
    _UPDATED_TEMPLATE = (
        ", updated AS ("
        # Written short: past 4,096 bytes psycopg parses a statement's text anew at every
        # execute (common.rendered), 22 us a flush for this one.
        "  UPDATE {s}.{j} j SET"
        "    status = CASE m.kind WHEN 'failed' THEN 'failed' ELSE 'queued' END::{s}.job_status,"
        "    run_at = CASE m.kind WHEN 'failed' THEN j.run_at"
        "             ELSE now() + make_interval(secs => m.delay) END,"
        "    max_attempts = j.max_attempts + (m.kind = 'snooze')::int,"
        "    last_error = nullif(right(concat_ws(E'\\n', j.last_error, m.error), 8000), ''),"
        "    finished_at = CASE m.kind WHEN 'failed' THEN now() END,"
        # A cancel asked for a job that now fails for good has nothing left to stop.
        "    locked_by = NULL, locked_at = NULL, cancel_requested_at = NULL"
        "  FROM mine m"
        "  WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE NOT arch)) AND j.id = m.id"
        "    AND j.status::text = 'running' AND j.locked_by = %(worker)s"
        "  RETURNING j.id, j.status, j.queue, j.priority, j.run_at,"
        "    CASE WHEN j.waited AND m.kind = 'failed' THEN pg_notify(%(done)s, j.id::text) END),"
        # Retried and snoozed rows are queued again: their queues' workers hear of them, with
        # their lanes (a floor above them is lowered). Referenced by every statement below as
        # a branch that returns no row, so that it is evaluated.
        " requeued AS (SELECT " + notify_lanes("(SELECT * FROM updated WHERE status = 'queued') u")
        + " AS n)"
    )
    _REQUEUED_NONE = " UNION ALL SELECT {nulls} FROM requeued WHERE n < 0"

    def _updated_rows(self, select: str, nulls: str) -> str:
        """The union branches of the updated rows (`select` FROM updated) and of the
        requeued notifications (none returned): nothing in a flush of done outcomes."""
        if self.outcomes in _DONE_SHAPES:
            return ""
        return f" UNION ALL SELECT {select} FROM updated" + self._REQUEUED_NONE.format(
            nulls=nulls)

    @property
    def _OUTCOME_CTES(self) -> str:
        # Plain (Statements.outcomes): for a batch of done outcomes without results and
        # of failures, the history row is the job's as it was, done: no join with the
        # outcomes, which cost a flush ~6 % of its server time (benchmarks/results/WAITS.md).
        archived = (
            "  INSERT INTO {s}.jobs_history ({h}) SELECT " + history_row("done")
            + " FROM finished RETURNING id, queue, status") if self.outcomes != ANY_OUTCOMES else (
            "  INSERT INTO {s}.jobs_history ({h}, result)"
            " SELECT " + history_row("", status_sql=(
                "CASE m.kind WHEN 'done' THEN 'done' ELSE 'cancelled' END::{s}.job_status"),
                last_error="nullif(right(concat_ws(E'\\n', last_error, m.error), 8000), '')")
            + "  , m.result FROM finished JOIN mine m USING (id) RETURNING id, queue, status")
        updated = "" if self.outcomes in _DONE_SHAPES else self._UPDATED_TEMPLATE
        # Through `jobs` (no partition named) the DELETE reads one partition after the
        # other, ids out of order across them: the rows are locked first there.
        done = self.outcomes == DONE_OUTCOMES and self.part is not None
        return (self._OUTCOME_TEMPLATE.replace("{fence}", "" if done else self._LOCKED)
                .replace("{arch}", self._DONE_ROWS if done else
                         "  WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE arch))")
                .replace("{archived}", archived) + updated)

    @cached_property
    def job_set_outcome_if_running_many(self) -> Statement:
        return self._compose(
            "WITH " + self._OUTCOME_CTES
            + " SELECT id FROM archived" + self._updated_rows("id", "NULL::bigint"))

    def _job_set_outcome_then_claim(self, next_due: str) -> Statement:
        # The flush and the next claim in one statement, one round trip and one commit: the
        # article's loop pays two of each per batch. The claim's snapshot predates the
        # outcomes, so a job retried here is claimable from the next statement on. Rows come
        # back as (true, claim columns...) for claimed jobs, (false, id, NULL...) for accepted
        # outcomes.
        nulls = ", NULL" * CLAIM_COLUMNS.count(",")
        return self._compose(
            "WITH " + self._OUTCOME_CTES
            + ", claimed AS (" + self._job_claim_update(next_due) + ")"
            " SELECT true, {c} FROM claimed"
            f" UNION ALL SELECT false, id{nulls}"
            " FROM (SELECT id FROM archived" + self._updated_rows("id", "NULL") + ") a")

    def _job_set_outcome_then_claim_from_floors(self, one_queue: bool,
                                                peek: bool) -> Statement:
        # As above, the claim from floors; its floors marker row (peek) comes with NULL first.
        nulls = ", NULL" * CLAIM_COLUMNS.count(",")
        return self._compose(
            "WITH " + self._OUTCOME_CTES + ", " + self._LANES
            + ", claimed AS (" + self._job_claim_update(self._next_due_from_floors(one_queue))
            + ")" + (", " + self._PEEK if peek else "") +
            " SELECT true, {c} FROM claimed"
            + (" UNION ALL SELECT NULL, m.* FROM (" + self._FLOORS_ROW + ") m" if peek else "")
            + f" UNION ALL SELECT false, id{nulls} FROM archived"
            + self._updated_rows(f"false, id{nulls}", f"NULL::boolean, NULL::bigint{nulls}"))

    @cached_property
    def job_set_outcome_if_running_many_then_claim_one_queue_from_floors(self) -> Statement:
        return self._job_set_outcome_then_claim_from_floors(one_queue=True, peek=False)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_many_queues_from_floors(
            self) -> Statement:
        return self._job_set_outcome_then_claim_from_floors(one_queue=False, peek=False)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_one_queue_from_floors_peek(
            self) -> Statement:
        return self._job_set_outcome_then_claim_from_floors(one_queue=True, peek=True)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_many_queues_from_floors_peek(
            self) -> Statement:
        return self._job_set_outcome_then_claim_from_floors(one_queue=False, peek=True)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_one_queue(self) -> Statement:
        return self._job_set_outcome_then_claim(self._next_due_one_queue())

    @cached_property
    def job_set_outcome_if_running_many_then_claim_many_queues(self) -> Statement:
        return self._job_set_outcome_then_claim(self._next_due_many_queues())

    def _job_set_outcome_then_claim_limited(self, next_due: str,
                                            queue_of: Callable[[str], str]) -> Statement:
        # The rows this statement finishes free their slots for its own claim: a key's next
        # job starts in the flush that completes the one before it.
        nulls = ", NULL" * CLAIM_COLUMNS.count(",")
        return self._compose(
            "WITH " + self._OUTCOME_CTES + ", "
            + self._job_claim_limited(
                next_due, "ARRAY(SELECT id FROM o ORDER BY id, attempt) AS ids,"
                " ARRAY(SELECT attempt FROM o ORDER BY id, attempt) AS attempts,"
                " ARRAY(SELECT kind IN ('done', 'failed', 'cancelled') FROM o"
                " ORDER BY id, attempt) AS final",
                queue_of)
            + " SELECT true, {c} FROM claimed"
            " UNION ALL SELECT NULL, m.* FROM (" + self._held_marker(queue_of) + ") m"
            f" UNION ALL SELECT false, id{nulls} FROM archived"
            + self._updated_rows(f"false, id{nulls}", f"NULL::boolean, NULL::bigint{nulls}"))

    @cached_property
    def job_set_outcome_if_running_many_then_claim_one_queue_limited(self) -> Statement:
        return self._job_set_outcome_then_claim_limited(
            self._next_due_one_queue(limited=True), self._in_one_queue)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_many_queues_limited(self) -> Statement:
        return self._job_set_outcome_then_claim_limited(
            self._next_due_many_queues(limited=True), self._in_many_queues)

    @cached_property
    def job_heartbeat_many(self) -> Statement:
        # Fenced on (id, attempts), as completions are: a job reaped and claimed again, even
        # by this same worker, no longer extends the lease of the attempt that was reaped.
        # Returns the (id, attempt) pairs still held; a missing pair's lease was lost. Rows are
        # locked in id order, as the completion statement locks them (no deadlock).
        return _q(
            "WITH held AS MATERIALIZED ("
            "  SELECT j.id FROM {s}.jobs j"
            "  JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS h(id, attempt)"
            "    ON h.id = j.id AND h.attempt = j.attempts"
            "  WHERE j.id = ANY(%(ids)s) AND j.status::text = 'running'"
            "    AND j.locked_by = %(worker)s"
            "  ORDER BY j.id FOR NO KEY UPDATE OF j)"
            " UPDATE {s}.jobs j SET locked_at = now() FROM held WHERE j.id = held.id"
            # The third column: a cancel was asked for (Queue.cancel), the fallback of its
            # notification.
            " RETURNING j.id, j.attempts, j.cancel_requested_at IS NOT NULL",
            self.schema,
        )

    @cached_property
    def job_set_progress_many(self) -> Statement:
        # job.set_progress, coalesced by the worker (_worker/progress.py). Fenced as the
        # heartbeat is, on (id, attempts) and locked_by, rows locked in id order as the
        # heartbeat and the completion lock them (no deadlock).
        return _q(
            "WITH held AS MATERIALIZED ("
            "  SELECT j.id, p.v FROM {s}.jobs j"
            "  JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[], %(values)s::text[])"
            "    AS p(id, attempt, v) ON p.id = j.id AND p.attempt = j.attempts"
            "  WHERE j.id = ANY(%(ids)s) AND j.status::text = 'running'"
            "    AND j.locked_by = %(worker)s"
            "  ORDER BY j.id FOR NO KEY UPDATE OF j)"
            " UPDATE {s}.jobs j SET progress = held.v::jsonb FROM held WHERE j.id = held.id",
            self.schema,
        )

    @cached_property
    def session_statement_timeout(self) -> sql.SQL:
        return sql.SQL("SELECT set_config('statement_timeout', %s, false)")

    @cached_property
    def local_statement_timeout(self) -> sql.SQL:
        # The same for one transaction: what a connection through a transaction pooler uses.
        return sql.SQL("SELECT set_config('statement_timeout', %s, true)")

    @cached_property
    def job_release_lost_claims(self) -> Statement:
        # Rows this worker claimed but never received (the claim committed, its reply was lost
        # with the connection): back to queued with the attempt uncounted, since no handler
        # ran. Rows it does hold (running, or outcome not yet written) are named in the
        # parameters and stay. Rows in %(counted)s, whose replies were lost again and again
        # (fetcher.py), keep the attempt, failed once the attempts are spent: a row whose claim
        # reply never arrives would otherwise be claimed for ever. Wakes the queues' workers,
        # as the reaper does.
        # A row whose cancel was asked for meanwhile (Queue.cancel found it running; no
        # handler of it runs) is cancelled, into history, rather than released to run. The
        # rows are locked first, in id order as every worker statement locks them, and the
        # cancel read from the locked (newest) versions: a cancel committed after this
        # statement's snapshot is neither missed by the one nor refused by the other.
        unheld = ("j.status = 'running' AND j.locked_by = %(worker)s"
                  " AND NOT EXISTS (SELECT FROM unnest(%(ids)s::bigint[], %(attempts)s::int[])"
                  "   AS h(id, attempt) WHERE h.id = j.id AND h.attempt = j.attempts)")
        return self._compose(
            "WITH l AS MATERIALIZED (SELECT j.id, j.cancel_requested_at IS NOT NULL AS cancel"
            "   FROM {s}.jobs j WHERE " + unheld + " ORDER BY j.id FOR UPDATE OF j),"
            " cancelled AS (DELETE FROM {s}.jobs j"
            "   WHERE j.id = ANY(ARRAY(SELECT id FROM l WHERE cancel)) AND " + unheld +
            "   RETURNING j.*),"
            " moved AS (INSERT INTO {s}.jobs_history ({h})"
            " SELECT " + history_row("cancelled") + " FROM cancelled RETURNING id, queue, status),"
            " counted AS (" + count_history("moved") + "),"
            " released AS ("
            " UPDATE {s}.jobs j SET"
            "   status = CASE WHEN j.id = ANY(%(counted)s::bigint[])"
            "     AND j.attempts >= j.max_attempts THEN 'failed' ELSE 'queued' END::{s}.job_status,"
            "   finished_at = CASE WHEN j.id = ANY(%(counted)s::bigint[])"
            "     AND j.attempts >= j.max_attempts THEN now() END,"
            "   attempts = CASE WHEN j.id = ANY(%(counted)s::bigint[]) THEN j.attempts"
            "     ELSE greatest(j.attempts - 1, 0) END,"
            "   last_error = CASE WHEN j.id = ANY(%(counted)s::bigint[])"
            "     THEN right(concat_ws(E'\\n', j.last_error, format('attempt %%s: claimed, but"
            " the reply of its claim was lost with the connection %%s times in a row', j.attempts,"
            " %(times)s::int)), 8000) ELSE j.last_error END,"
            "   locked_by = NULL, locked_at = NULL"
            " WHERE j.id = ANY(ARRAY(SELECT id FROM l WHERE NOT cancel)) AND " + unheld +
            " RETURNING j.id, j.queue, j.priority, j.run_at, j.status, j.waited)"
            " SELECT (SELECT coalesce(array_agg(id), '{{}}') FROM released), "
            + notify_lanes("(SELECT * FROM released WHERE status = 'queued') r") + ","
            # The lanes it requeued into, [[queue, priority, earliest run_at], ...]: this
            # worker's own next claim must not wait for the notification to lower its floors.
            " (SELECT coalesce(json_agg(json_build_array(queue, priority,"
            "   extract(epoch FROM at))), '[]') FROM (SELECT queue, priority, min(run_at) AS at"
            "   FROM released WHERE status = 'queued' GROUP BY queue, priority) l), "
            + notify_waited("(SELECT id, waited FROM released WHERE status = 'failed'"
                            " UNION ALL SELECT id, waited FROM cancelled)"))

    @cached_property
    def job_move_to_task_queue(self) -> Statement:
        # A job of a limited task claimed by a worker that does not apply the task's limits
        # (it serves the queue the job was written into, not the task's; misplaced.py): back
        # to queued in the task's own queue, run_at kept, the attempt uncounted since no
        # handler ran (the claim added it). Fenced as outcomes are, on (status, locked_by,
        # attempts): a job reaped and claimed again meanwhile is left to its newer attempt.
        # Wakes the target queue's workers with the job's run_at, as an insert's trigger does.
        return _q(
            "WITH moved AS ("
            " UPDATE {s}.jobs SET status = 'queued', queue = %(queue)s,"
            "   attempts = greatest(attempts - 1, 0), locked_by = NULL, locked_at = NULL"
            " WHERE id = %(id)s AND status::text = 'running' AND locked_by = %(worker)s"
            "   AND attempts = %(attempt)s"
            " RETURNING id, queue, priority, run_at)"
            " SELECT id, " + notify_lanes("moved") + " FROM moved",
            self.schema,
        )

    @staticmethod
    def _worker_plan_settings(is_local: bool) -> Statement:
        # A generic plan is kept until the table's statistics change. Made while ANALYZE
        # knew only a few rows, it looked claimed ids up by a sequential scan of the whole
        # table (cheapest for one page), then kept doing so once a backlog arrived, until
        # autovacuum analyzed again: 5 ms a claim at 100,000 jobs instead of 0.05 ms. Every
        # statement of these connections finds its rows by an index, so none needs one.
        # plan_cache_mode exists from PostgreSQL 12 on; older servers keep planning each time.
        # JIT off: a generic plan of the limited claim is estimated past jit_above_cost once
        # the table is large, and compiling it took a second on every claim.
        # Bitmap scans off: a flush of done outcomes locks its rows in the order its DELETE
        # reads them (WorkerStatements._DONE_ROWS), which is id order only for a plain index
        # scan; a bitmap heap scan, chosen while the table is tiny and then kept, reads them
        # in the heap's order.
        return sql.SQL(
            "SELECT set_config('enable_seqscan', 'off', {local}),"
            " set_config('enable_bitmapscan', 'off', {local}),"
            " set_config('jit', 'off', {local}),"
            " CASE WHEN current_setting('server_version_num')::int >= 120000"
            " THEN set_config('plan_cache_mode', 'force_generic_plan', {local}) END"
        ).format(local=sql.Literal(is_local))

    @cached_property
    def session_worker_plans(self) -> Statement:
        return self._worker_plan_settings(is_local=False)

    # doctor: the claim plan workers run. Their connections plan generically
    # (session_worker_plans), and EXPLAIN of the statement with its parameters bound shows a
    # plan made for those values, which can read the table differently. The claim is PREPAREd
    # with positional parameters and EXPLAINed as EXECUTE under force_generic_plan instead
    # (EXPLAIN (GENERIC_PLAN) cannot ANALYZE, and needs PostgreSQL 16).
    DOCTOR_CLAIM = "asyncjobq_doctor_claim"

    @cached_property
    def doctor_worker_plans_local(self) -> Statement:
        return self._worker_plan_settings(is_local=True)

    @cached_property
    def job_claim_one_queue_prepare(self) -> Statement:
        # The placeholders are this module's own, swapped in the template before composing.
        template = self._job_claim_update(self._next_due_one_queue())
        for placeholder, position in (("%(worker)s", "$1"), ("%(queue)s", "$2"),
                                      ("%(limit)s", "$3")):
            template = template.replace(placeholder, position)
        return sql.SQL("PREPARE {} (text, text, bigint) AS ").format(
            sql.Identifier(self.DOCTOR_CLAIM)) + self._compose(template)

    def job_claim_one_queue_explain(self, worker: str, queue: str, limit: int) -> Statement:
        # Measured for real (ANALYZE); the caller runs it in a rolled-back transaction.
        return sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}({}, {}, {})").format(
            sql.Identifier(self.DOCTOR_CLAIM), sql.Literal(worker), sql.Literal(queue),
            sql.Literal(limit))

    @cached_property
    def doctor_claim_prepared(self) -> Statement:
        return sql.SQL("SELECT 1 FROM pg_prepared_statements WHERE name = {}").format(
            sql.Literal(self.DOCTOR_CLAIM))

    @cached_property
    def job_claim_one_queue_deallocate(self) -> Statement:
        return sql.SQL("DEALLOCATE {}").format(sql.Identifier(self.DOCTOR_CLAIM))
