"""Maintenance: the reaper, the leader, the pruner, the hot-table vacuum and the periodic
scheduler."""

from __future__ import annotations

from functools import cached_property

from psycopg import sql

from .common import (
    GEN,
    HORIZON_HOLDERS,
    Role,
    Statement,
    _advisory_xact_lock,
    _q,
    count_history,
    history_row,
    notify_lanes,
    notify_waited,
    rendered,
)

# The workflow edges (0012_workflows.sql) of the jobs a prune deleted (`deleted`, with their
# ids): a child's edges go with it. A parent's stay while its children live (`get` shows them).
_UNLINKED = (" unlinked AS (DELETE FROM {s}.job_deps d USING deleted"
             "  WHERE d.child_id = deleted.id)")


class MaintenanceStatements(Role):

    @cached_property
    def reaper_try_lock(self) -> Statement:
        return _advisory_xact_lock(f"asyncjobq.reaper.{self.schema}", wait=False)

    @cached_property
    def job_reap_stuck(self) -> Statement:
        # Running rows whose holder stopped heartbeating for longer than the lease: requeue,
        # or fail once the attempts are spent (a job that keeps killing workers is a poison pill).
        # Requeued rows wake their queues' workers with their lanes (notify_lanes).
        # A stuck job whose cancel was asked for (0011_results.sql) is cancelled instead, into
        # history: its worker is gone, and no retry follows a cancel. Jobs made final that a
        # `Queue.wait` looks for notify <schema>_done.
        return self._compose(
            "WITH stuck AS ("
            " SELECT id, locked_by FROM {s}.jobs WHERE status = 'running'"
            "   AND locked_at < now() - make_interval(secs => %(lease)s)"
            " ORDER BY locked_at LIMIT %(limit)s FOR NO KEY UPDATE SKIP LOCKED),"
            " cancelled AS (DELETE FROM {s}.jobs j USING stuck"
            "   WHERE j.id = stuck.id AND j.cancel_requested_at IS NOT NULL RETURNING j.*),"
            " moved AS (INSERT INTO {s}.jobs_history ({h})"
            " SELECT " + history_row("cancelled", last_error=(
                "right(concat_ws(E'\\n', last_error, format('attempt %%s: cancelled, as asked"
                " at %%s; its worker %%s stopped heartbeating at %%s', attempts,"
                " cancel_requested_at, locked_by, locked_at)), 8000)")) +
            " FROM cancelled RETURNING id, queue, status),"
            " counted AS (" + count_history("moved") + "),"
            " reaped AS (UPDATE {s}.jobs j SET"
            "   status = CASE WHEN j.attempts >= j.max_attempts THEN 'failed'"
            "                 ELSE 'queued' END::{s}.job_status,"
            "   finished_at = CASE WHEN j.attempts >= j.max_attempts THEN now() END,"
            "   run_at = now(),"
            "   last_error = right(concat_ws(E'\\n', j.last_error,"
            "     format('attempt %%s: lease expired, worker %%s stopped heartbeating at %%s',"
            "            j.attempts, j.locked_by, j.locked_at)), 8000),"
            "   locked_by = NULL, locked_at = NULL"
            " FROM stuck WHERE j.id = stuck.id AND j.cancel_requested_at IS NULL"
            " RETURNING j.id, j.status, j.queue, j.task, stuck.locked_by, j.priority, j.run_at,"
            "   j.waited)"
            # Notifications in a CTE of their own, referenced by a branch that returns no row:
            # evaluated whichever of the two others has rows.
            ", told AS (SELECT "
            + notify_lanes("(SELECT * FROM reaped WHERE status = 'queued') r") + " AS n, "
            + notify_waited("(SELECT id, waited FROM reaped WHERE status = 'failed' UNION ALL"
                            " SELECT id, waited FROM cancelled)") + " AS w)"
            " SELECT id, status::text, queue, task, locked_by FROM reaped"
            " UNION ALL SELECT id, 'cancelled', queue, task, locked_by FROM cancelled"
            " UNION ALL SELECT NULL, NULL, NULL, NULL, NULL FROM told WHERE n < 0 OR w < 0"
        )

    # --- maintenance: leadership ------------------------------------------------------------

    @cached_property
    def leader_elect(self) -> Statement:
        # Take the row when it is free or expired, renew it when it is ours; either way the
        # current leader comes back, with `held`: true only when this statement wrote the row.
        # The fallback SELECT reads the statement's snapshot, which may predate another
        # worker's takeover and still name this one: only a written row makes a leader.
        # Expiry is judged by the server's clock alone.
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
            " SELECT worker, elected_at, true AS held FROM attempt"
            " UNION ALL SELECT worker, elected_at, false FROM {s}.leader"
            "   WHERE name = 'default' AND NOT EXISTS (SELECT FROM attempt)"
            " LIMIT 1",
            self.schema,
        )

    @cached_property
    def leader_resign(self) -> Statement:
        return _q("DELETE FROM {s}.leader WHERE worker = %(worker)s", self.schema)

    @cached_property
    def leader_get(self) -> Statement:
        return _q(
            "SELECT worker, elected_at, expires_at FROM {s}.leader"
            " WHERE name = 'default' AND expires_at > now()",
            self.schema,
        )

    # --- maintenance: pruning ----------------------------------------------------------------

    @cached_property
    def pruner_try_lock(self) -> Statement:
        return _advisory_xact_lock(f"asyncjobq.prune.{self.schema}", wait=False)

    @cached_property
    def pruner_lock(self) -> Statement:
        return _advisory_xact_lock(f"asyncjobq.prune.{self.schema}", wait=True)

    @cached_property
    def job_history_delete_expired(self) -> Statement:
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
            # A parent stays while a child of it is live: the child reads its result when
            # it runs (0012_workflows.sql).
            "    AND NOT EXISTS (SELECT FROM {s}.job_deps d JOIN {s}.jobs c"
            "      ON c.id = d.child_id WHERE d.parent_id = h.id)"
            "  LIMIT %(limit)s),"
            " deleted AS ("
            "  DELETE FROM {s}.jobs_history h USING doomed WHERE h.id = doomed.id"
            "  RETURNING h.id, h.queue),"
            + _UNLINKED +
            " SELECT queue, count(*) FROM deleted GROUP BY queue",
            self.schema,
        )

    @cached_property
    def history_counts_fold(self) -> Statement:
        # The writers' shards (1..64) summed into shard 0, in one statement so that stats()
        # sees either the shards or their sum, never neither. Rows are locked in key order
        # first, the order in which the history triggers lock them: a writer and the fold
        # cannot deadlock. A writer waiting on a deleted shard row inserts it anew.
        return _q(
            "WITH locked AS MATERIALIZED ("
            "  SELECT queue, status, shard FROM {s}.history_counts WHERE shard <> 0"
            "  ORDER BY queue, status, shard FOR UPDATE),"
            " moved AS ("
            "  DELETE FROM {s}.history_counts c USING locked l"
            "  WHERE c.queue = l.queue AND c.status = l.status AND c.shard = l.shard"
            "  RETURNING c.queue, c.status, c.n)"
            " INSERT INTO {s}.history_counts AS c (queue, status, shard, n)"
            " SELECT queue, status, 0, sum(n) FROM moved GROUP BY queue, status"
            " ORDER BY queue, status"
            " ON CONFLICT (queue, status, shard) DO UPDATE SET n = c.n + excluded.n",
            self.schema,
        )

    @cached_property
    def history_counts_delete_empty(self) -> Statement:
        # Queues whose history is all pruned would otherwise keep a zero row for good.
        return _q("DELETE FROM {s}.history_counts WHERE shard = 0 AND n = 0", self.schema)

    @cached_property
    def job_failed_delete_older(self) -> Statement:
        # Dead-lettered jobs are only deleted on purpose (`prune --failed`), in bounded batches.
        return _q(
            "WITH doomed AS ("
            "  SELECT id FROM {s}.jobs WHERE status = 'failed'"
            "    AND finished_at < now() - make_interval(secs => %(age)s)"
            "    AND (%(queue)s::text IS NULL OR queue = %(queue)s)"
            "  LIMIT %(limit)s FOR UPDATE SKIP LOCKED),"
            " deleted AS ("
            "  DELETE FROM {s}.jobs j USING doomed WHERE j.id = doomed.id"
            "  RETURNING j.id, j.queue),"
            + _UNLINKED +
            " SELECT queue, count(*) FROM deleted GROUP BY queue",
            self.schema,
        )

    # --- maintenance: vacuum of the hot table ---------------------------------------------------

    @cached_property
    def _hot_vacuum_key(self) -> Statement:
        return sql.SQL("hashtext({})").format(sql.Literal(f"asyncjobq.vacuum.{self.schema}"))

    @cached_property
    def hot_vacuum_try_lock(self) -> Statement:
        # Session-scoped (VACUUM cannot run in a transaction); released by hot_vacuum_unlock.
        return sql.SQL("SELECT pg_try_advisory_lock({})").format(self._hot_vacuum_key)

    @cached_property
    def hot_vacuum_unlock(self) -> Statement:
        return sql.SQL("SELECT pg_advisory_unlock({})").format(self._hot_vacuum_key)

    @cached_property
    def hot_vacuum_end_abandoned(self) -> Statement:
        # The session of a VACUUM whose connection the client closed mid-statement: the server
        # notices only once the VACUUM is over, and keeps the lock until then. Only a session
        # that still holds the lock is ended, so a pid reused meanwhile is never hit. A bigint
        # advisory key shows in pg_locks as its high half (classid) and low half (objid).
        return sql.SQL(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks l"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted"
            "   AND l.pid = %(pid)s"
            "   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            "   AND l.classid = (({key}::bigint >> 32) & 4294967295)::oid"
            "   AND l.objid = ({key}::bigint & 4294967295)::oid"
        ).format(key=self._hot_vacuum_key)

    @cached_property
    def job_table_dead_tuples(self) -> Statement:
        # Only the owner (or a superuser) may vacuum: say so rather than try and be refused.
        # Then: the server's clock, and whether a session of this database has
        # held the xmin horizon since %(since)s, when the leader's last vacuum began (NULL: no
        # such vacuum known). That vacuum could remove no row deleted after it began, and
        # neither can the next: it would only read the table, which grows while the horizon
        # stays.
        # jobs is partitioned (0013_generations.sql): its partitions' statistics, summed.
        return sql.SQL(
            "SELECT coalesce(sum(s.n_dead_tup), 0), coalesce(sum(s.n_live_tup), 0),"
            "  extract(epoch FROM now() - max(greatest(s.last_vacuum, s.last_autovacuum))),"
            "  pg_has_role(c.relowner, 'USAGE'), now(),"
            "  coalesce(o.since < %(since)s::timestamptz, false),"
            # How long the oldest session holding the horizon now has held it (NULL: none).
            "  extract(epoch FROM now() - o.since)"
            " FROM pg_class c JOIN pg_inherits i ON i.inhparent = c.oid"
            "  JOIN pg_stat_user_tables s ON s.relid = i.inhrelid,"
            "  (SELECT min(h.since) AS since FROM (" + HORIZON_HOLDERS + ") h) o"
            " WHERE c.oid = to_regclass({})"
            " GROUP BY c.relowner, o.since"
        ).format(sql.Literal(f'"{self.schema}".jobs'))

    # --- maintenance: generations of jobs (0013_generations.sql, _maintenance/rotation.py) ---

    @cached_property
    def generation_state(self) -> Statement:
        # The current generation; the bytes of its partition (indexes and TOAST too); whether
        # the other partition holds a queued row (read through its claim index: its entries
        # of rows claimed since are bounded by the partition's size); for how many seconds
        # the oldest session holding the xmin horizon has held it (NULL: none).
        part = [sql.Literal(f'"{self.schema}".jobs_{g}') for g in (0, 1)]
        return rendered(sql.SQL(
            "SELECT g.gen, pg_total_relation_size(CASE g.gen WHEN 0 THEN {p0}::regclass"
            "  ELSE {p1}::regclass END),"
            " CASE g.gen WHEN 0 THEN EXISTS (SELECT FROM {s}.jobs_1 WHERE status = 'queued')"
            "  ELSE EXISTS (SELECT FROM {s}.jobs_0 WHERE status = 'queued') END,"
            " (SELECT extract(epoch FROM now() - min(h.since)) FROM (" + HORIZON_HOLDERS
            + ") h)"
            " FROM {s}.generation g").format(s=sql.Identifier(self.schema), p0=part[0],
                                             p1=part[1]))

    @cached_property
    def generation_sweep(self) -> Statement:
        return _q("SELECT {s}.move_queued_jobs(%(n)s)", self.schema)

    @cached_property
    def generation_drain(self) -> Statement:
        return _q("SELECT {s}.drain_old_jobs(%(n)s)", self.schema)

    @cached_property
    def generation_rotate(self) -> Statement:
        return _q("SELECT {s}.rotate_jobs(%(n)s)", self.schema)

    @cached_property
    def read_committed(self) -> Statement:
        return sql.SQL("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")

    @cached_property
    def job_table_vacuum(self) -> Statement:
        # SKIP_LOCKED: if autovacuum (or another worker) is at it, skip rather than queue.
        # INDEX_CLEANUP ON: PostgreSQL skips the indexes when few heap pages have dead rows,
        # but the claim index's dead entries are exactly what this vacuum is for.
        return _q("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) {s}.jobs", self.schema)

    # --- maintenance: periodic scheduler ------------------------------------------------------

    @cached_property
    def periodic_last_ticks(self) -> Statement:
        # The latest recorded tick of each schedule (one backward index probe per name) and
        # the server's clock, which every leader judges due ticks by.
        return _q(
            "SELECT n.name,"
            " (SELECT max(t.tick) FROM {s}.periodic_ticks t WHERE t.name = n.name),"
            " now()"
            " FROM unnest(%(names)s::text[]) AS n(name)",
            self.schema,
        )

    @cached_property
    def periodic_ticks_enqueue(self) -> Statement:
        # Every due tick of every schedule in one statement: a tick's row and its job are
        # written together or not at all. A tick is written only when it is later than its
        # schedule's latest row (so a leader working from a stale read writes nothing) and
        # only once (the primary key; a second leader's INSERT waits for the first one's and
        # then does nothing). Rows are inserted in key order so that two leaders writing the
        # same ticks wait for each other rather than deadlock. Ticks whose `enqueue` is false
        # mark where a new schedule starts and get no job. The jobs' INSERT trigger notifies
        # the earliest run_at per queue only; the later ticks written ahead get a
        # notification each (same text as the trigger's, which PostgreSQL folds into one), so
        # workers wake for every tick on time rather than at their next poll.
        return _q(
            "WITH spec AS ("
            "  SELECT r->>0 AS name, r->>1 AS task, r->2 AS payload, r->>3 AS queue,"
            "    (r->>4)::int AS priority, (r->>5)::int AS max_attempts"
            "  FROM jsonb_array_elements(%(schedules)s::jsonb) AS s(r)),"
            " due AS ("
            "  SELECT r->>0 AS name, (r->>1)::timestamptz AS tick, (r->>2)::boolean AS enqueue"
            "  FROM jsonb_array_elements(%(ticks)s::jsonb) AS d(r)),"
            " fresh AS ("
            "  INSERT INTO {s}.periodic_ticks (name, tick, enqueued)"
            "  SELECT d.name, d.tick, d.enqueue FROM due d"
            "  WHERE d.tick > coalesce((SELECT max(p.tick) FROM {s}.periodic_ticks p"
            "                           WHERE p.name = d.name), '-infinity')"
            "  ORDER BY d.name, d.tick"
            "  ON CONFLICT (name, tick) DO NOTHING"
            "  RETURNING name, tick, enqueued),"
            " jobs AS ("
            "  INSERT INTO {s}.jobs (task, payload, queue, priority, run_at, max_attempts, gen)"
            "  SELECT s.task, s.payload, s.queue, s.priority, f.tick, s.max_attempts, " + GEN +
            "  FROM fresh f JOIN spec s ON s.name = f.name WHERE f.enqueued"
            "  ORDER BY f.tick"
            "  RETURNING queue, run_at)"
            " SELECT (SELECT count(*) FROM jobs),"
            " (SELECT count(*) FROM (SELECT pg_notify(%(channel)s, json_build_object("
            "   'queue', queue, 'run_at', extract(epoch FROM run_at),"
            # jobs_notify named their lanes already: only a wake-up here.
            "   'lanes', '[]'::json)::text)"
            "   FROM (SELECT DISTINCT queue, run_at FROM jobs WHERE run_at > now()) d) n)",
            self.schema,
        )

    @cached_property
    def periodic_ticks_forget_future(self) -> Statement:
        # The server's clock was set back (scheduler.py): rows past it would hold their
        # schedules until the clock caught up.
        return _q(
            "DELETE FROM {s}.periodic_ticks"
            " WHERE name = ANY(%(names)s::text[]) AND tick > %(after)s",
            self.schema,
        )

    @cached_property
    def periodic_ticks_prune(self) -> Statement:
        # Each schedule's latest row is where its next tick is computed from: it stays.
        return _q(
            "DELETE FROM {s}.periodic_ticks t"
            " WHERE t.tick < now() - make_interval(secs => %(keep)s)"
            "   AND EXISTS (SELECT FROM {s}.periodic_ticks n"
            "               WHERE n.name = t.name AND n.tick > t.tick)",
            self.schema,
        )
