"""Install and migrations, the admin calls (get, stats, health, retry, cancel) and doctor's
read-only health checks."""

from __future__ import annotations

from psycopg import sql

from .common import (
    HISTORY_COLUMNS,
    INFO_COLUMNS,
    IndexDefinition,
    Role,
    _advisory_xact_lock,
    _q,
    history_row,
)


class AdminStatements(Role):
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

    # --- read / admin ----------------------------------------------------------------------

    @property
    def job_get_by_id(self) -> sql.Composed:
        return sql.SQL(
            "SELECT {c} FROM {s}.jobs WHERE id = %(id)s"
            " UNION ALL SELECT {c} FROM {s}.jobs_history WHERE id = %(id)s LIMIT 1"
        ).format(c=sql.SQL(INFO_COLUMNS), s=sql.Identifier(self.schema))

    @property
    def job_count_by_queue_status(self) -> sql.Composed:
        # History is not counted here but read from the counts its triggers keep
        # (0003_history_counts.sql): a few rows per queue, whatever the history's size. The
        # live table is counted: it holds only queued, running and failed jobs.
        return _q(
            "SELECT queue, status::text, count(*) FROM {s}.jobs GROUP BY 1, 2"
            " UNION ALL"
            " SELECT queue, status::text, sum(n) FROM {s}.history_counts GROUP BY 1, 2"
            " HAVING sum(n) <> 0",
            self.schema,
        )

    @property
    def queue_health(self) -> sql.Composed:
        # For `status`: oldest due queued job, stale running rows, completions in the last minute.
        # History is read once, for the last minute only: the BRIN index on finished_at limits
        # the scan to the ranges holding recent rows. A per-queue count of recent done rows
        # let the planner AND that index with the (since dropped) (queue, status) one, which
        # read every done row of each queue.
        return _q(
            "WITH recent AS ("
            "  SELECT queue, count(*) FILTER (WHERE status = 'done') AS done"
            "  FROM {s}.jobs_history WHERE finished_at > now() - interval '1 minute'"
            "  GROUP BY queue)"
            " SELECT q.queue,"
            " (SELECT extract(epoch FROM now() - min(j.run_at)) FROM {s}.jobs j"
            "   WHERE j.queue = q.queue AND j.status = 'queued' AND j.run_at <= now()),"
            " (SELECT count(*) FROM {s}.jobs j WHERE j.queue = q.queue AND j.status = 'running'"
            "   AND j.locked_at < now() - make_interval(secs => %s)),"
            " coalesce(r.done, 0)"
            " FROM (SELECT DISTINCT queue FROM {s}.jobs UNION SELECT queue FROM recent) q"
            " LEFT JOIN recent r ON r.queue = q.queue",
            self.schema,
        )

    @property
    def job_retry_failed(self) -> sql.Composed:
        return self.job_retry_failed_at_most(capped=False)

    def job_retry_failed_at_most(self, *, capped: bool) -> sql.Composed:
        # `capped`: only the newest %(limit)s matching jobs (a bulk action's preview count).
        # At most one queued-or-running job per dedup_key (jobs_dedup_idx): of the matching
        # failed jobs sharing a key, only the newest is requeued, and none while a live job
        # holds the key; the others stay failed and are counted as skipped. A live job
        # committed after this statement's snapshot still raises UniqueViolation: the caller
        # runs it again, and the next snapshot sees that job.
        return _q(
            "WITH matching AS ("
            " SELECT j.id, j.dedup_key FROM {s}.jobs j"
            " WHERE j.status = 'failed'"
            "   AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)"
            "   AND (%(task)s::text IS NULL OR j.task = %(task)s)"
            "   AND (%(error_like)s::text IS NULL OR j.last_error LIKE %(error_like)s)"
            "   AND (%(max_id)s::bigint IS NULL OR j.id <= %(max_id)s)"
            + (" ORDER BY j.id DESC LIMIT %(limit)s" if capped else "") + "),"
            " chosen AS ("
            " SELECT id FROM matching WHERE dedup_key IS NULL"
            " UNION ALL"
            " SELECT n.id FROM (SELECT DISTINCT ON (dedup_key) id, dedup_key FROM matching"
            "   WHERE dedup_key IS NOT NULL ORDER BY dedup_key, id DESC) n"
            " WHERE NOT EXISTS (SELECT 1 FROM {s}.jobs o WHERE o.dedup_key = n.dedup_key"
            "   AND o.status IN ('queued', 'running'))),"
            " requeued AS ("
            " UPDATE {s}.jobs j SET status = 'queued', attempts = 0, run_at = now(),"
            "   finished_at = NULL"
            " FROM chosen WHERE j.id = chosen.id AND j.status = 'failed'"
            " RETURNING j.queue)"
            " SELECT (SELECT count(*) FROM requeued),"
            " (SELECT count(*) FROM matching) - (SELECT count(*) FROM requeued),"
            " (SELECT count(*) FROM (SELECT pg_notify(%(channel)s, json_build_object("
            "   'queue', queue, 'run_at', extract(epoch FROM now()))::text)"
            "   FROM (SELECT DISTINCT queue FROM requeued) d) n)",
            self.schema,
        )

    @property
    def periodic_schedule_ticks(self) -> sql.Composed:
        # For `schedules`: per name, the latest tick that got a job, the latest row of any
        # kind (where the scheduler goes on from) and the server's clock.
        return _q(
            "SELECT n.name,"
            " (SELECT max(t.tick) FROM {s}.periodic_ticks t"
            "   WHERE t.name = n.name AND t.enqueued),"
            " (SELECT max(t.tick) FROM {s}.periodic_ticks t WHERE t.name = n.name),"
            " now()"
            " FROM unnest(%(names)s::text[]) AS n(name)",
            self.schema,
        )

    @property
    def periodic_ticks_latest(self) -> sql.Composed:
        # For `status`: every schedule the database knows of (the app is not loaded there).
        return _q(
            "SELECT name, max(tick) FILTER (WHERE enqueued) FROM {s}.periodic_ticks"
            " GROUP BY name ORDER BY name",
            self.schema,
        )

    @property
    def job_cancel(self) -> sql.Composed:
        return sql.SQL(
            "WITH cancelled AS ("
            " DELETE FROM {s}.jobs WHERE id = %s AND status = 'queued' RETURNING *)"
            " INSERT INTO {s}.jobs_history ({h})"
            " SELECT " + history_row("cancelled") +
            " FROM cancelled RETURNING id"
        ).format(s=sql.Identifier(self.schema), h=sql.SQL(HISTORY_COLUMNS))

    # --- limits (0007_flow_control.sql) ----------------------------------------------------

    @property
    def flow_usage(self) -> sql.Composed:
        # Per limited task: its running jobs, the keys they hold, its starts in the last period.
        return _q(
            "SELECT t.task,"
            " (SELECT count(*) FROM {s}.jobs r"
            "   WHERE r.task = t.task AND r.status = 'running' AND r.flow),"
            " (SELECT count(DISTINCT r.key) FROM {s}.jobs r"
            "   WHERE r.task = t.task AND r.status = 'running' AND r.flow AND r.key IS NOT NULL),"
            " (SELECT count(*) FROM {s}.flow_starts f WHERE f.task = t.task"
            "   AND f.started_at > clock_timestamp() - make_interval(secs => t.period))"
            " FROM unnest(%(tasks)s::text[], %(periods)s::float8[]) AS t(task, period)"
            " ORDER BY t.task",
            self.schema,
        )

    # --- pause / resume (0006_paused_queues.sql) --------------------------------------------

    @property
    def queue_pause(self) -> sql.Composed:
        # Returns the row whether it was paused now or already: pausing twice is not an error.
        return _q(
            "WITH added AS (INSERT INTO {s}.paused_queues (queue) VALUES (%(queue)s)"
            "   ON CONFLICT (queue) DO NOTHING RETURNING paused_at)"
            " SELECT paused_at, true FROM added"
            " UNION ALL SELECT paused_at, false FROM {s}.paused_queues"
            "   WHERE queue = %(queue)s AND NOT EXISTS (SELECT FROM added)",
            self.schema,
        )

    @property
    def queue_resume(self) -> sql.Composed:
        # Wakes the queue's workers, as an enqueue does: they claim at once, not at their poll.
        return _q(
            "WITH removed AS (DELETE FROM {s}.paused_queues WHERE queue = %(queue)s"
            "   RETURNING queue)"
            " SELECT count(*), (SELECT count(*) FROM (SELECT pg_notify(%(channel)s,"
            "   json_build_object('queue', queue, 'run_at', extract(epoch FROM now()))::text)"
            "   FROM removed) n) FROM removed",
            self.schema,
        )

    # Every claim reads paused_queues, so it holds an AccessShareLock on it until it commits;
    # its locks are taken before its snapshot. The transactions holding one right after a
    # pause committed are the claims that may not have seen it (Queue.pause waits them out).
    # pg_locks, not pg_stat_activity: any role may read it, whatever the application name.
    @property
    def paused_queues_lockers(self) -> sql.Composed:
        return self._on_paused_queues(
            "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{{}}') FROM pg_locks"
            " WHERE relation = {t} AND pid <> pg_backend_pid()")

    @property
    def paused_queues_lockers_left(self) -> sql.Composed:
        return self._on_paused_queues(
            "SELECT count(*) FROM pg_locks WHERE relation = {t}"
            " AND virtualtransaction = ANY(%(vxids)s::text[])")

    def _on_paused_queues(self, template: str) -> sql.Composed:
        table = sql.Identifier(self.schema, "paused_queues").as_string(None)
        return sql.SQL(template).format(t=sql.SQL("{}::regclass").format(sql.Literal(table)))

    @property
    def queue_paused_list(self) -> sql.Composed:
        return _q("SELECT queue, paused_at FROM {s}.paused_queues ORDER BY queue", self.schema)

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

    # --- doctor: the fixes it advises (shown to the user, never run by asyncjobq) -------------

    def index_create_concurrently(self, index: IndexDefinition) -> sql.Composed:
        # CONCURRENTLY: a plain CREATE INDEX holds a SHARE lock on the table for the whole
        # build, stopping every claim, completion and heartbeat (past the lease, the reaper
        # then requeues healthy running jobs). One statement, schema-qualified, since
        # CONCURRENTLY refuses to run in a transaction, which a multi-statement string is.
        return sql.SQL("CREATE {unique}INDEX CONCURRENTLY {name} ON {s}.{table} {definition}"
                       ).format(unique=sql.SQL("UNIQUE " if index.unique else ""),
                                name=sql.Identifier(index.name), s=sql.Identifier(self.schema),
                                table=sql.Identifier(index.table),
                                definition=sql.SQL(index.definition))

    def index_drop_concurrently(self, index: str) -> sql.Composed:
        return sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {s}.{name}").format(
            s=sql.Identifier(self.schema), name=sql.Identifier(index))

    def index_reindex_concurrently(self, index: str) -> sql.Composed:
        return sql.SQL("REINDEX INDEX CONCURRENTLY {s}.{name}").format(
            s=sql.Identifier(self.schema), name=sql.Identifier(index))

    @property
    def doctor_server(self) -> sql.SQL:
        return sql.SQL(
            "SELECT current_setting('server_version'), current_setting('autovacuum'),"
            "  current_setting('track_counts'), pg_notification_queue_usage()"
        )

    @property
    def doctor_history_counts_drift(self) -> sql.Composed:
        # history_counts (0003_history_counts.sql) against a count of every history row:
        # they part only if rows were written with the triggers disabled, or a data-only
        # restore loaded both the rows and their counts. Reads all of history, as only doctor
        # may.
        return _q(
            "SELECT coalesce(c.queue, h.queue), coalesce(c.status, h.status)::text,"
            "  coalesce(c.n, 0), coalesce(h.n, 0)"
            " FROM (SELECT queue, status, sum(n) AS n FROM {s}.history_counts"
            "       GROUP BY 1, 2) c"
            " FULL JOIN (SELECT queue, status, count(*) AS n FROM {s}.jobs_history"
            "            GROUP BY 1, 2) h ON h.queue = c.queue AND h.status = c.status"
            " WHERE coalesce(c.n, 0) <> coalesce(h.n, 0) ORDER BY 1, 2",
            self.schema,
        )

    @property
    def history_counts_recount(self) -> sql.Composed:
        # The doctor's advice for a drift (shown, never run by asyncjobq): the lock holds
        # history's writers back until the new counts commit, as the migration's backfill.
        return _q(
            "BEGIN; LOCK TABLE {s}.jobs_history IN SHARE ROW EXCLUSIVE MODE;"
            " TRUNCATE {s}.history_counts;"
            " INSERT INTO {s}.history_counts (queue, status, shard, n)"
            " SELECT queue, status, 0, count(*) FROM {s}.jobs_history GROUP BY 1, 2; COMMIT",
            self.schema,
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

    @property
    def migrations_table_exists(self) -> sql.Composed:
        return sql.SQL("SELECT to_regclass({}) IS NOT NULL").format(
            sql.Literal(f'"{self.schema}".migrations')
        )
