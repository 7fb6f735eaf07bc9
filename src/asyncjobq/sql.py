"""Every SQL statement asyncjobq runs, named for what it does (River's style).

Statements are composed with psycopg.sql; the schema is always an Identifier and user data is
always a bound parameter. `Statements(schema)` builds the set once per schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

from psycopg import sql

# Columns returned to the worker by a claim, in this order (see fetcher.ClaimedJob).
CLAIM_COLUMNS = "id, task, queue, payload, priority, attempts, max_attempts, run_at, created_at"
# Columns of JobInfo, in this order.
INFO_COLUMNS = (
    "id, task, queue, status, attempts, max_attempts, priority, run_at, last_error, "
    "created_at, finished_at, payload"
)
# Columns shared by jobs and jobs_history, for moving a finished row.
HISTORY_COLUMNS = (
    "id, queue, task, payload, status, priority, run_at, attempts, max_attempts, "
    "dedup_key, locked_by, last_error, created_at, finished_at"
)


def _q(template: str, schema: str) -> sql.Composed:
    """Fill `{s}` with the schema identifier; everything else in the template is literal SQL."""
    return sql.SQL(template).format(s=sql.Identifier(schema))


def _advisory_xact_lock(key: str, *, wait: bool) -> sql.Composed:
    # Transaction-scoped, so a crashed holder can never leave it taken.
    fn = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    return sql.SQL("SELECT {}(hashtext({}))").format(sql.SQL(fn), sql.Literal(key))


@dataclass(frozen=True)
class Statements:
    schema: str

    # --- install / migrations -------------------------------------------------------------

    @property
    def install_lock(self) -> sql.Composed:
        return _advisory_xact_lock(f"asyncjobq.install.{self.schema}", wait=True)

    @property
    def schema_create(self) -> sql.Composed:
        return _q("CREATE SCHEMA IF NOT EXISTS {s}", self.schema)

    @property
    def search_path_set_local(self) -> sql.Composed:
        return _q("SET LOCAL search_path TO {s}", self.schema)

    @property
    def migrations_table_create(self) -> sql.Composed:
        return _q(
            "CREATE TABLE IF NOT EXISTS {s}.migrations ("
            " version int PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())",
            self.schema,
        )

    @property
    def migration_versions(self) -> sql.Composed:
        return _q("SELECT version FROM {s}.migrations ORDER BY version", self.schema)

    @property
    def migration_record(self) -> sql.Composed:
        return _q("INSERT INTO {s}.migrations (version, name) VALUES (%s, %s)", self.schema)

    # --- enqueue ---------------------------------------------------------------------------

    @property
    def job_insert(self) -> sql.Composed:
        # A live duplicate dedup_key returns the existing job's id. DO NOTHING (not a no-op
        # DO UPDATE) keeps producers free of UPDATE privilege; when the duplicate was committed
        # after this statement's snapshot, no id comes back and the caller runs it again.
        return _q(
            "WITH ins AS ("
            " INSERT INTO {s}.jobs (task, payload, queue, priority, run_at, max_attempts,"
            "   dedup_key)"
            " VALUES (%(task)s, %(payload)s, %(queue)s, %(priority)s,"
            "   coalesce(%(run_at)s, now()) + make_interval(secs => %(delay)s),"
            "   %(max_attempts)s, %(dedup_key)s)"
            " ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL"
            "   AND status IN ('queued', 'running') DO NOTHING"
            " RETURNING id)"
            " SELECT id FROM ins"
            " UNION ALL"
            " SELECT id FROM {s}.jobs WHERE dedup_key = %(dedup_key)s"
            "   AND status IN ('queued', 'running') AND NOT EXISTS (SELECT FROM ins)"
            " LIMIT 1",
            self.schema,
        )

    @cached_property
    def job_insert_rows(self) -> sql.Composed:
        # Jobs of coalesced enqueue() calls (see inserter), each its own task, queue and
        # schedule: one JSON array of [task, payload, queue, priority, run_at, delay,
        # max_attempts] rows; ids come back in row order.
        return _q(
            "INSERT INTO {s}.jobs (task, payload, queue, priority, run_at, max_attempts)"
            " SELECT r->>0, r->1, r->>2, (r->>3)::int,"
            "   coalesce((r->>4)::timestamptz, now()) + make_interval(secs => (r->>5)::float8),"
            "   (r->>6)::int"
            " FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS t(r, n) ORDER BY n"
            " RETURNING id",
            self.schema,
        )

    @property
    def job_insert_many(self) -> sql.Composed:
        # One statement for any number of payloads, sent as one JSON array: parsing one
        # document server-side costs far less than a jsonb[] of many (measured ~2x).
        return _q(
            "INSERT INTO {s}.jobs (task, payload, queue, priority, run_at, max_attempts)"
            " SELECT %s, p, %s, %s, coalesce(%s, now()) + make_interval(secs => %s), %s"
            " FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS t(p, n) ORDER BY n"
            " RETURNING id",
            self.schema,
        )

    # --- read / admin ----------------------------------------------------------------------

    @property
    def job_get_by_id(self) -> sql.Composed:
        return sql.SQL(
            "SELECT {c} FROM {s}.jobs WHERE id = %(id)s"
            " UNION ALL SELECT {c} FROM {s}.jobs_history WHERE id = %(id)s LIMIT 1"
        ).format(c=sql.SQL(INFO_COLUMNS), s=sql.Identifier(self.schema))

    @property
    def job_count_by_queue_status(self) -> sql.Composed:
        return _q(
            "SELECT queue, status::text, count(*) FROM {s}.jobs GROUP BY 1, 2"
            " UNION ALL"
            " SELECT queue, status::text, count(*) FROM {s}.jobs_history GROUP BY 1, 2",
            self.schema,
        )

    @property
    def queue_health(self) -> sql.Composed:
        # For `status`: oldest due queued job, stale running rows, completions in the last minute.
        return _q(
            "SELECT q.queue,"
            " (SELECT extract(epoch FROM now() - min(j.run_at)) FROM {s}.jobs j"
            "   WHERE j.queue = q.queue AND j.status = 'queued' AND j.run_at <= now()),"
            " (SELECT count(*) FROM {s}.jobs j WHERE j.queue = q.queue AND j.status = 'running'"
            "   AND j.locked_at < now() - make_interval(secs => %s)),"
            " (SELECT count(*) FROM {s}.jobs_history h WHERE h.queue = q.queue"
            "   AND h.status = 'done' AND h.finished_at > now() - interval '1 minute')"
            " FROM (SELECT DISTINCT queue FROM {s}.jobs"
            "       UNION SELECT DISTINCT queue FROM {s}.jobs_history"
            "       WHERE finished_at > now() - interval '1 minute') q",
            self.schema,
        )

    @property
    def job_retry_failed(self) -> sql.Composed:
        # A failed job whose dedup_key is held by a live job stays failed: requeueing it would
        # break the one-live-job-per-key rule.
        return _q(
            "WITH requeued AS ("
            " UPDATE {s}.jobs j SET status = 'queued', attempts = 0, run_at = now(),"
            "   finished_at = NULL"
            " WHERE j.status = 'failed'"
            "   AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)"
            "   AND (%(task)s::text IS NULL OR j.task = %(task)s)"
            "   AND (%(error_like)s::text IS NULL OR j.last_error LIKE %(error_like)s)"
            "   AND (j.dedup_key IS NULL OR NOT EXISTS (SELECT 1 FROM {s}.jobs o"
            "        WHERE o.dedup_key = j.dedup_key AND o.status IN ('queued', 'running')))"
            " RETURNING j.queue)"
            " SELECT (SELECT count(*) FROM requeued),"
            " (SELECT count(*) FROM (SELECT pg_notify(%(channel)s, json_build_object("
            "   'queue', queue, 'run_at', extract(epoch FROM now()))::text)"
            "   FROM (SELECT DISTINCT queue FROM requeued) d) n)",
            self.schema,
        )

    @property
    def job_cancel(self) -> sql.Composed:
        return sql.SQL(
            "WITH cancelled AS ("
            " DELETE FROM {s}.jobs WHERE id = %s AND status = 'queued' RETURNING *)"
            " INSERT INTO {s}.jobs_history ({h})"
            " SELECT id, queue, task, payload, 'cancelled', priority, run_at, attempts,"
            "   max_attempts, dedup_key, locked_by, last_error, created_at, now()"
            " FROM cancelled RETURNING id"
        ).format(s=sql.Identifier(self.schema), h=sql.SQL(HISTORY_COLUMNS))

    # --- worker: claim, complete, heartbeat, release, reap ---------------------------------

    def _job_claim_update(self, next_due: str) -> str:
        # One statement: lock the next due rows (skipping rows other workers hold) and mark
        # them running. FOR NO KEY UPDATE does not block foreign-key inserts into child tables.
        # = ANY(ARRAY(...)), not IN (...): a generic plan knows neither the queue nor the limit
        # and guesses that IN returns a tenth of the table, then hash-joins it against a
        # sequential scan; an array's ids are looked up by primary key whatever its size.
        return (
            "UPDATE {s}.jobs SET status = 'running', locked_by = %(worker)s,"
            "   locked_at = now(), attempts = attempts + 1"
            f" WHERE id = ANY(ARRAY({next_due}))"
            " RETURNING {c}"
        )

    def _compose(self, template: str) -> sql.Composed:
        return sql.SQL(template).format(s=sql.Identifier(self.schema), c=sql.SQL(CLAIM_COLUMNS),
                                        h=sql.SQL(HISTORY_COLUMNS))

    @staticmethod
    def _next_due_of_queue(queue: str) -> str:
        # The next due rows of one queue, in claim order, a priority at a time: the recursive
        # part steps down jobs_dequeue_idx from one priority to the next (one index descent
        # each), and each priority's due rows are a range of the index, since run_at follows
        # priority in it. One scan over all priorities with run_at <= now() as a filter
        # walked every not-yet-due job of every priority it passed (15 ms a claim with
        # 200,000 jobs delayed and none due). PostgreSQL evaluates the recursion only as far
        # as the LIMIT pulls, so a claim that fills up in the first priority never descends
        # further, and only rows it returns are locked. The rows come out in claim order by
        # construction (priorities descending, a nested loop over them), not by a sort.
        return (
            "WITH RECURSIVE p AS ("
            "  (SELECT priority FROM {s}.jobs"
            f"   WHERE queue = {queue} AND status = 'queued'"
            "   ORDER BY priority DESC LIMIT 1)"
            "  UNION ALL"
            "  SELECT (SELECT j.priority FROM {s}.jobs j"
            f"   WHERE j.queue = {queue} AND j.status = 'queued' AND j.priority < p.priority"
            "   ORDER BY j.priority DESC LIMIT 1)"
            "  FROM p WHERE p.priority IS NOT NULL)"
            " SELECT n.id, n.priority, n.run_at FROM p CROSS JOIN LATERAL ("
            "  SELECT id, priority, run_at FROM {s}.jobs"
            f"  WHERE queue = {queue} AND status = 'queued' AND priority = p.priority"
            "    AND run_at <= now()"
            "  ORDER BY run_at, id LIMIT %(limit)s"
            "  FOR NO KEY UPDATE SKIP LOCKED) n"
            " LIMIT %(limit)s"
        )

    @property
    def _next_due_one_queue(self) -> str:
        return "SELECT id FROM (" + self._next_due_of_queue("%(queue)s") + ") d"

    # Several queues: each queue's next rows, then the first of those. One scan with
    # queue = ANY(...) cannot read the index in claim order, so it sorted every due job of the
    # queues on every claim (260 ms a claim with 1,000,000 queued). The price: each queue's
    # next `limit` rows are locked, up to (queues - 1) x limit more than are claimed. They stay
    # queued, and other workers' claims skip them until this statement commits; with a
    # backlog those claims take the rows after them, but when a few jobs are all that is due,
    # another worker can come back short and wait for its next wake-up, while this one claims
    # the rest with its next batch.
    @property
    def _next_due_many_queues(self) -> str:
        return (
            "SELECT c.id FROM unnest(%(queues)s::text[]) AS q(name)"
            " CROSS JOIN LATERAL (" + self._next_due_of_queue("q.name") + ") c"
            " ORDER BY c.priority DESC, c.run_at, c.id LIMIT %(limit)s")

    @cached_property
    def job_claim_one_queue(self) -> sql.Composed:
        return self._compose(self._job_claim_update(self._next_due_one_queue))

    @cached_property
    def job_claim_many_queues(self) -> sql.Composed:
        return self._compose(self._job_claim_update(self._next_due_many_queues))

    # Writing outcomes, one statement per flush for every outcome kind. Each row is fenced on
    # (status, locked_by, attempts): a worker presumed dead cannot overwrite a newer attempt.
    # `done` rows move to jobs_history; the rest are updated in place. The accepted ids come
    # back from `archived` and `updated`; the caller logs the refused ones.
    _OUTCOME_CTES = (
        # One JSON parameter, [[id, attempt, kind, delay, error], ...]: one encoder call in
        # the worker, where five arrays cost psycopg's per-element array dumping.
        "o AS ("
        "  SELECT (e->>0)::bigint AS id, (e->>1)::int AS attempt, e->>2 AS kind,"
        "    (e->>3)::float8 AS delay, e->>4 AS error"
        "  FROM jsonb_array_elements(%(outcomes)s::jsonb) AS e),"
        # Lock the rows in id order first, as the heartbeat does: two statements that lock
        # overlapping rows in different orders deadlock (seen in the soak benchmark). Rows are
        # found by primary key (= ANY(ARRAY(...))): a join lets the planner walk every running
        # row of the table once per outcome, which made a flush of 50 cost milliseconds.
        " locked AS MATERIALIZED ("
        "  SELECT j.id, j.attempts FROM {s}.jobs j"
        "  WHERE j.id = ANY(ARRAY(SELECT id FROM o))"
        "    AND j.status = 'running' AND j.locked_by = %(worker)s"
        "  ORDER BY j.id FOR UPDATE OF j),"
        " mine AS MATERIALIZED ("
        "  SELECT o.* FROM o JOIN locked l ON l.id = o.id AND l.attempts = o.attempt),"
        " finished AS ("
        "  DELETE FROM {s}.jobs j"
        "  WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind = 'done'))"
        "    AND j.status = 'running' AND j.locked_by = %(worker)s"
        "  RETURNING j.*),"
        " archived AS ("
        "  INSERT INTO {s}.jobs_history ({h})"
        "  SELECT id, queue, task, payload, 'done', priority, run_at, attempts,"
        "    max_attempts, dedup_key, locked_by, last_error, created_at, now()"
        "  FROM finished RETURNING id),"
        " updated AS ("
        "  UPDATE {s}.jobs j SET"
        "    status = CASE WHEN m.kind = 'failed' THEN 'failed'"
        "                  ELSE 'queued' END::{s}.job_status,"
        "    run_at = CASE WHEN m.kind = 'failed' THEN j.run_at"
        "                  ELSE now() + make_interval(secs => m.delay) END,"
        "    max_attempts = j.max_attempts + CASE WHEN m.kind = 'snooze' THEN 1 ELSE 0 END,"
        "    last_error = CASE WHEN m.error IS NULL THEN j.last_error"
        "                      ELSE right(concat_ws(E'\\n', j.last_error, m.error), 8000) END,"
        "    finished_at = CASE WHEN m.kind = 'failed' THEN now() END,"
        "    locked_by = NULL, locked_at = NULL"
        "  FROM mine m"
        "  WHERE j.id = ANY(ARRAY(SELECT id FROM mine WHERE kind <> 'done')) AND j.id = m.id"
        "    AND j.status = 'running' AND j.locked_by = %(worker)s"
        "  RETURNING j.id)"
    )

    @cached_property
    def job_set_outcome_if_running_many(self) -> sql.Composed:
        return self._compose(
            "WITH " + self._OUTCOME_CTES
            + " SELECT id FROM archived UNION ALL SELECT id FROM updated")

    def _job_set_outcome_then_claim(self, next_due: str) -> sql.Composed:
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
            f" UNION ALL SELECT false, id{nulls} FROM archived"
            f" UNION ALL SELECT false, id{nulls} FROM updated")

    @cached_property
    def job_set_outcome_if_running_many_then_claim_one_queue(self) -> sql.Composed:
        return self._job_set_outcome_then_claim(self._next_due_one_queue)

    @cached_property
    def job_set_outcome_if_running_many_then_claim_many_queues(self) -> sql.Composed:
        return self._job_set_outcome_then_claim(self._next_due_many_queues)

    @property
    def job_heartbeat_many(self) -> sql.Composed:
        # Fenced on (id, attempts), as completions are: a job reaped and claimed again, even
        # by this same worker, no longer extends the lease of the attempt that was reaped.
        # Returns the (id, attempt) pairs still held; a missing pair's lease was lost. Rows are
        # locked in id order, as the completion statement locks them (no deadlock).
        return _q(
            "WITH held AS MATERIALIZED ("
            "  SELECT j.id FROM {s}.jobs j"
            "  JOIN unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS h(id, attempt)"
            "    ON h.id = j.id AND h.attempt = j.attempts"
            "  WHERE j.id = ANY(%(ids)s) AND j.status = 'running' AND j.locked_by = %(worker)s"
            "  ORDER BY j.id FOR NO KEY UPDATE OF j)"
            " UPDATE {s}.jobs j SET locked_at = now() FROM held WHERE j.id = held.id"
            " RETURNING j.id, j.attempts",
            self.schema,
        )

    @property
    def session_statement_timeout(self) -> sql.SQL:
        return sql.SQL("SELECT set_config('statement_timeout', %s, false)")

    @property
    def job_release_lost_claims(self) -> sql.Composed:
        # Rows this worker claimed but never received (the claim committed, its reply was lost
        # with the connection): back to queued with the attempt uncounted, since no handler
        # ran. Rows it does hold (running, or outcome not yet written) are named in the
        # parameters and stay. Wakes the queues' workers, as the reaper does.
        return _q(
            "WITH released AS ("
            " UPDATE {s}.jobs j SET status = 'queued', attempts = greatest(j.attempts - 1, 0),"
            "   locked_by = NULL, locked_at = NULL"
            " WHERE j.status = 'running' AND j.locked_by = %(worker)s"
            "   AND NOT EXISTS (SELECT FROM unnest(%(ids)s::bigint[], %(attempts)s::int[])"
            "     AS h(id, attempt) WHERE h.id = j.id AND h.attempt = j.attempts)"
            " RETURNING j.id, j.queue)"
            " SELECT (SELECT count(*) FROM released),"
            " (SELECT count(*) FROM (SELECT pg_notify(%(channel)s, json_build_object("
            "   'queue', queue, 'run_at', extract(epoch FROM now()))::text)"
            "   FROM (SELECT DISTINCT queue FROM released) d) n)",
            self.schema,
        )

    @staticmethod
    def _worker_plan_settings(is_local: bool) -> sql.Composed:
        # A generic plan is kept until the table's statistics change. Made while ANALYZE
        # knew only a few rows, it looked claimed ids up by a sequential scan of the whole
        # table (cheapest for one page), then kept doing so once a backlog arrived, until
        # autovacuum analyzed again: 5 ms a claim at 100,000 jobs instead of 0.05 ms. Every
        # statement of these connections finds its rows by an index, so none needs one.
        # plan_cache_mode exists from PostgreSQL 12 on; older servers keep planning each time.
        return sql.SQL(
            "SELECT set_config('enable_seqscan', 'off', {local}),"
            " CASE WHEN current_setting('server_version_num')::int >= 120000"
            " THEN set_config('plan_cache_mode', 'force_generic_plan', {local}) END"
        ).format(local=sql.Literal(is_local))

    @property
    def session_worker_plans(self) -> sql.Composed:
        return self._worker_plan_settings(is_local=False)

    @property
    def queue_notify(self) -> sql.SQL:
        # Wake workers of a queue explicitly (requeued by the reaper, not by an INSERT).
        return sql.SQL(
            "SELECT pg_notify(%(channel)s, json_build_object("
            "'queue', %(queue)s::text, 'run_at', extract(epoch FROM now()))::text)"
        )

    @property
    def reaper_try_lock(self) -> sql.Composed:
        return _advisory_xact_lock(f"asyncjobq.reaper.{self.schema}", wait=False)

    @property
    def job_reap_stuck(self) -> sql.Composed:
        # Running rows whose holder stopped heartbeating for longer than the lease: requeue,
        # or fail once the attempts are spent (a job that keeps killing workers is a poison pill).
        return _q(
            "WITH stuck AS ("
            " SELECT id, locked_by FROM {s}.jobs WHERE status = 'running'"
            "   AND locked_at < now() - make_interval(secs => %(lease)s)"
            " ORDER BY locked_at LIMIT %(limit)s FOR NO KEY UPDATE SKIP LOCKED)"
            " UPDATE {s}.jobs j SET"
            "   status = CASE WHEN j.attempts >= j.max_attempts THEN 'failed'"
            "                 ELSE 'queued' END::{s}.job_status,"
            "   finished_at = CASE WHEN j.attempts >= j.max_attempts THEN now() END,"
            "   run_at = now(),"
            "   last_error = right(concat_ws(E'\\n', j.last_error,"
            "     format('attempt %%s: lease expired, worker %%s stopped heartbeating at %%s',"
            "            j.attempts, j.locked_by, j.locked_at)), 8000),"
            "   locked_by = NULL, locked_at = NULL"
            " FROM stuck WHERE j.id = stuck.id"
            " RETURNING j.id, j.status::text, j.queue, j.task, stuck.locked_by",
            self.schema,
        )

    # --- maintenance: leadership ------------------------------------------------------------

    @property
    def leader_elect(self) -> sql.Composed:
        # Take the row when it is free or expired, renew it when it is ours; either way the
        # current leader comes back. Expiry is judged by the server's clock alone.
        return _q(
            "WITH attempt AS ("
            " INSERT INTO {s}.leader AS l (name, worker, elected_at, expires_at)"
            " VALUES ('default', %(worker)s, now(), now() + make_interval(secs => %(ttl)s))"
            " ON CONFLICT (name) DO UPDATE SET worker = excluded.worker,"
            "   elected_at = CASE WHEN l.worker = excluded.worker THEN l.elected_at"
            "                     ELSE now() END,"
            "   expires_at = excluded.expires_at"
            " WHERE l.worker = excluded.worker OR l.expires_at < now()"
            " RETURNING worker, elected_at)"
            " SELECT worker, elected_at FROM attempt"
            " UNION ALL SELECT worker, elected_at FROM {s}.leader"
            "   WHERE name = 'default' AND NOT EXISTS (SELECT FROM attempt)"
            " LIMIT 1",
            self.schema,
        )

    @property
    def leader_resign(self) -> sql.Composed:
        return _q("DELETE FROM {s}.leader WHERE worker = %(worker)s", self.schema)

    @property
    def leader_get(self) -> sql.Composed:
        return _q(
            "SELECT worker, elected_at, expires_at FROM {s}.leader"
            " WHERE name = 'default' AND expires_at > now()",
            self.schema,
        )

    # --- maintenance: pruning ----------------------------------------------------------------

    @property
    def pruner_try_lock(self) -> sql.Composed:
        return _advisory_xact_lock(f"asyncjobq.prune.{self.schema}", wait=False)

    @property
    def pruner_lock(self) -> sql.Composed:
        return _advisory_xact_lock(f"asyncjobq.prune.{self.schema}", wait=True)

    @property
    def job_history_delete_expired(self) -> sql.Composed:
        # One bounded batch. Per-queue ages come as parallel arrays; queues not listed use
        # %(default_age)s; a NULL age keeps that queue's history forever. The first finished_at
        # bound (the smallest age of all) lets the BRIN index skip the recent part of history.
        return _q(
            "WITH r AS ("
            "  SELECT * FROM unnest(%(queues)s::text[], %(ages)s::float8[]) AS r(queue, age)),"
            " doomed AS ("
            "  SELECT h.id FROM {s}.jobs_history h LEFT JOIN r ON r.queue = h.queue"
            "  WHERE h.finished_at < now() - make_interval(secs => %(min_age)s)"
            "    AND h.finished_at < now() - make_interval(secs =>"
            "      CASE WHEN r.queue IS NULL THEN %(default_age)s ELSE r.age END)"
            "  LIMIT %(limit)s),"
            " deleted AS ("
            "  DELETE FROM {s}.jobs_history h USING doomed WHERE h.id = doomed.id"
            "  RETURNING h.queue)"
            " SELECT queue, count(*) FROM deleted GROUP BY queue",
            self.schema,
        )

    @property
    def job_failed_delete_older(self) -> sql.Composed:
        # Dead-lettered jobs are only deleted on purpose (`prune --failed`), in bounded batches.
        return _q(
            "WITH doomed AS ("
            "  SELECT id FROM {s}.jobs WHERE status = 'failed'"
            "    AND finished_at < now() - make_interval(secs => %(age)s)"
            "    AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
            "  LIMIT %(limit)s FOR UPDATE SKIP LOCKED),"
            " deleted AS ("
            "  DELETE FROM {s}.jobs j USING doomed WHERE j.id = doomed.id RETURNING j.queue)"
            " SELECT queue, count(*) FROM deleted GROUP BY queue",
            self.schema,
        )

    # --- maintenance: vacuum of the hot table ---------------------------------------------------

    @property
    def hot_vacuum_try_lock(self) -> sql.Composed:
        # Session-scoped (VACUUM cannot run in a transaction); released by hot_vacuum_unlock.
        return sql.SQL("SELECT pg_try_advisory_lock(hashtext({}))").format(
            sql.Literal(f"asyncjobq.vacuum.{self.schema}"))

    @property
    def hot_vacuum_unlock(self) -> sql.Composed:
        return sql.SQL("SELECT pg_advisory_unlock(hashtext({}))").format(
            sql.Literal(f"asyncjobq.vacuum.{self.schema}"))

    @property
    def job_table_dead_tuples(self) -> sql.Composed:
        # Only the owner (or a superuser) may vacuum: say so rather than try and be refused.
        return sql.SQL(
            "SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),"
            "  extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum)),"
            "  pg_has_role(c.relowner, 'USAGE')"
            " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid"
            " WHERE c.oid = to_regclass({})"
        ).format(sql.Literal(f'"{self.schema}".jobs'))

    @property
    def job_table_vacuum(self) -> sql.Composed:
        # SKIP_LOCKED: if autovacuum (or another worker) is at it, skip rather than queue.
        # INDEX_CLEANUP ON: PostgreSQL skips the indexes when few heap pages have dead rows,
        # but the claim index's dead entries are exactly what this vacuum is for.
        return _q("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) {s}.jobs", self.schema)

    # --- doctor: read-only health checks ----------------------------------------------------

    @property
    def doctor_table_stats(self) -> sql.Composed:
        # Tuple counts come from the statistics collector: estimates, flushed about once a second.
        return sql.SQL(
            "SELECT c.relname, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),"
            "  pg_table_size(c.oid), pg_indexes_size(c.oid),"
            "  s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze,"
            "  coalesce(s.autovacuum_count, 0), coalesce(c.reloptions, '{{}}')"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
            " WHERE n.nspname = {schema} AND c.relkind = 'r'"
            "   AND c.relname IN ('jobs', 'jobs_history')"
            " ORDER BY c.relname"
        ).format(schema=sql.Literal(self.schema))

    @property
    def doctor_index_stats(self) -> sql.Composed:
        return sql.SQL(
            "SELECT t.relname, i.relname, ix.indisvalid, pg_relation_size(i.oid),"
            "  coalesce(s.idx_scan, 0)"
            " FROM pg_index ix"
            " JOIN pg_class i ON i.oid = ix.indexrelid"
            " JOIN pg_class t ON t.oid = ix.indrelid"
            " JOIN pg_namespace n ON n.oid = t.relnamespace"
            " LEFT JOIN pg_stat_user_indexes s ON s.indexrelid = i.oid"
            " WHERE n.nspname = {schema} ORDER BY t.relname, i.relname"
        ).format(schema=sql.Literal(self.schema))

    @property
    def doctor_xmin_holders(self) -> sql.SQL:
        # Sessions whose snapshot or transaction id holds back the xmin horizon: while they are
        # open, vacuum cannot remove any row deleted after they began, in any table.
        return sql.SQL(
            "SELECT pid, coalesce(usename, ''), coalesce(application_name, ''), state,"
            "  extract(epoch FROM now() - xact_start),"
            "  greatest(age(backend_xid), age(backend_xmin)), left(query, 200)"
            " FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid() AND datname = current_database()"
            "   AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)"
            "   AND xact_start < now() - make_interval(secs => %(age)s)"
            " ORDER BY xact_start"
        )

    @property
    def doctor_prepared_xacts(self) -> sql.SQL:
        return sql.SQL(
            "SELECT gid, extract(epoch FROM now() - prepared), age(transaction)"
            " FROM pg_prepared_xacts WHERE database = current_database()"
            "   AND prepared < now() - make_interval(secs => %(age)s)"
        )

    @property
    def doctor_replication_slots(self) -> sql.SQL:
        return sql.SQL(
            "SELECT slot_name, active, greatest(age(xmin), age(catalog_xmin))"
            " FROM pg_replication_slots WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL"
        )

    @property
    def doctor_server(self) -> sql.SQL:
        return sql.SQL(
            "SELECT current_setting('server_version'), current_setting('autovacuum'),"
            "  current_setting('track_counts'), pg_notification_queue_usage()"
        )

    @property
    def job_count_stale_running(self) -> sql.Composed:
        return _q(
            "SELECT count(*), extract(epoch FROM now() - min(locked_at)) FROM {s}.jobs"
            " WHERE status = 'running' AND locked_at < now() - make_interval(secs => %(lease)s)",
            self.schema,
        )

    @property
    def queue_list_queued(self) -> sql.Composed:
        return _q("SELECT DISTINCT queue FROM {s}.jobs WHERE status = 'queued' ORDER BY 1",
                  self.schema)

    @property
    def doctor_set_local_timeouts(self) -> sql.SQL:
        return sql.SQL("SET LOCAL lock_timeout = '1s'; SET LOCAL statement_timeout = '10s'")

    @property
    def server_now(self) -> sql.SQL:
        return sql.SQL("SELECT now()")

    # doctor: the claim plan workers run. Their connections plan generically
    # (session_worker_plans), and EXPLAIN of the statement with its parameters bound shows a
    # plan made for those values, which can read the table differently. The claim is PREPAREd
    # with positional parameters and EXPLAINed as EXECUTE under force_generic_plan instead
    # (EXPLAIN (GENERIC_PLAN) cannot ANALYZE, and needs PostgreSQL 16).
    DOCTOR_CLAIM = "asyncjobq_doctor_claim"

    @property
    def doctor_worker_plans_local(self) -> sql.Composed:
        return self._worker_plan_settings(is_local=True)

    @property
    def job_claim_one_queue_prepare(self) -> sql.Composed:
        # The placeholders are this module's own, swapped in the template before composing.
        template = self._job_claim_update(self._next_due_one_queue)
        for placeholder, position in (("%(worker)s", "$1"), ("%(queue)s", "$2"),
                                      ("%(limit)s", "$3")):
            template = template.replace(placeholder, position)
        return sql.SQL("PREPARE {} (text, text, bigint) AS ").format(
            sql.Identifier(self.DOCTOR_CLAIM)) + self._compose(template)

    def job_claim_one_queue_explain(self, worker: str, queue: str, limit: int) -> sql.Composed:
        # Measured for real (ANALYZE); the caller runs it in a rolled-back transaction.
        return sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {}({}, {}, {})").format(
            sql.Identifier(self.DOCTOR_CLAIM), sql.Literal(worker), sql.Literal(queue),
            sql.Literal(limit))

    @property
    def doctor_claim_prepared(self) -> sql.Composed:
        return sql.SQL("SELECT 1 FROM pg_prepared_statements WHERE name = {}").format(
            sql.Literal(self.DOCTOR_CLAIM))

    @property
    def job_claim_one_queue_deallocate(self) -> sql.Composed:
        return sql.SQL("DEALLOCATE {}").format(sql.Identifier(self.DOCTOR_CLAIM))

    @property
    def migrations_table_exists(self) -> sql.Composed:
        return sql.SQL("SELECT to_regclass({}) IS NOT NULL").format(
            sql.Literal(f'"{self.schema}".migrations')
        )


@cache
def statements(schema: str) -> Statements:
    return Statements(schema)
