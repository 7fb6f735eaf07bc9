"""Install and migrations, and the admin calls (get, stats, health, retry, cancel, pause,
resume). Doctor's checks are doctor.py's."""

from __future__ import annotations

from functools import cached_property

from psycopg import sql

from .common import (
    HISTORY_INFO_COLUMNS,
    INFO_COLUMNS,
    Role,
    Statement,
    _advisory_xact_lock,
    _q,
    count_history,
    history_row,
    notify_lanes,
    notify_waited,
)


class AdminStatements(Role):
    # --- install / migrations -------------------------------------------------------------

    @cached_property
    def install_lock(self) -> Statement:
        return _advisory_xact_lock(f"asyncjobq.install.{self.schema}", wait=True)

    @cached_property
    def schema_create(self) -> Statement:
        return _q("CREATE SCHEMA IF NOT EXISTS {s}", self.schema)

    @cached_property
    def search_path_set_local(self) -> Statement:
        return _q("SET LOCAL search_path TO {s}", self.schema)

    @cached_property
    def migrations_table_create(self) -> Statement:
        return _q(
            "CREATE TABLE IF NOT EXISTS {s}.migrations ("
            " version int PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())",
            self.schema,
        )

    @cached_property
    def migration_versions(self) -> Statement:
        return _q("SELECT version FROM {s}.migrations ORDER BY version", self.schema)

    @cached_property
    def migration_record(self) -> Statement:
        return _q("INSERT INTO {s}.migrations (version, name) VALUES (%s, %s)", self.schema)

    @cached_property
    def migrations_table_exists(self) -> Statement:
        return sql.SQL("SELECT to_regclass({}) IS NOT NULL").format(
            sql.Literal(f'"{self.schema}".migrations')
        )

    # --- read / admin ----------------------------------------------------------------------

    def _job_info_where(self, where: str, tail: str = "") -> Statement:
        # JobInfo's columns of the jobs matching `where`, live or finished.
        return sql.SQL(
            "SELECT {c} FROM {s}.jobs WHERE " + where +
            " UNION ALL SELECT {h} FROM {s}.jobs_history WHERE " + where + tail
        ).format(c=sql.SQL(INFO_COLUMNS), h=sql.SQL(HISTORY_INFO_COLUMNS),
                 s=sql.Identifier(self.schema))

    @cached_property
    def job_get_by_id(self) -> Statement:
        return self._job_info_where("id = %(id)s", " LIMIT 1")

    @cached_property
    def job_get_many(self) -> Statement:
        # Queue.wait's look at the jobs it waits for, a batch at a time (_waiting.py).
        return self._job_info_where("id = ANY(%(ids)s)")

    @cached_property
    def job_mark_waited(self) -> Statement:
        # Queue.wait: from now on the statements that make these jobs final notify
        # <schema>_done of them (0011_results.sql). Rows already marked are not written again.
        # Rows locked in id order first, as the worker's statements lock them: no deadlock.
        return _q("WITH l AS (SELECT id FROM {s}.jobs WHERE id = ANY(%(ids)s)"
                  "   AND waited IS NOT TRUE ORDER BY id FOR NO KEY UPDATE)"
                  " UPDATE {s}.jobs j SET waited = true FROM l WHERE j.id = l.id", self.schema)

    @cached_property
    def job_count_by_queue_status(self) -> Statement:
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

    @cached_property
    def queue_health(self) -> Statement:
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

    @cached_property
    def job_retry_failed(self) -> Statement:
        return self.job_retry_failed_at_most(capped=False)

    def job_retry_failed_at_most(self, *, capped: bool) -> Statement:
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
            " RETURNING j.queue, j.priority, j.run_at)"
            " SELECT (SELECT count(*) FROM requeued),"
            " (SELECT count(*) FROM matching) - (SELECT count(*) FROM requeued), "
            + notify_lanes("requeued"),
            self.schema,
        )

    @cached_property
    def periodic_schedule_ticks(self) -> Statement:
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

    @cached_property
    def periodic_ticks_latest(self) -> Statement:
        # For `status`: every schedule the database knows of (the app is not loaded there).
        return _q(
            "SELECT name, max(tick) FILTER (WHERE enqueued) FROM {s}.periodic_ticks"
            " GROUP BY name ORDER BY name",
            self.schema,
        )

    @cached_property
    def job_cancel(self) -> Statement:
        # A queued (or waiting) job is cancelled now, into history (its children as they say,
        # 0012_workflows.sql). A running one is asked to stop: its worker hears the id on
        # <schema>_cancel (its heartbeat's reply as the fallback) and writes `cancelled`, fenced
        # as every outcome; a worker that died leaves it to the reaper, which cancels it
        # (0011_results.sql). Returns 'cancelled', 'asked', or nothing.
        return self._compose(
            "WITH cancelled AS ("
            " DELETE FROM {s}.jobs WHERE id = %(id)s AND status IN ('queued', 'waiting')"
            " RETURNING *),"
            " moved AS (INSERT INTO {s}.jobs_history ({h})"
            " SELECT " + history_row("cancelled") +
            " FROM cancelled RETURNING id, queue, status),"
            " counted AS (" + count_history("moved") + "),"
            " asked AS (UPDATE {s}.jobs SET cancel_requested_at = coalesce(cancel_requested_at,"
            "   now()) WHERE id = %(id)s AND status = 'running' RETURNING id),"
            " told AS (SELECT " + notify_waited("cancelled") + " AS w,"
            "   (SELECT count(pg_notify(%(cancel)s, id::text)) FROM asked) AS c)"
            " SELECT 'cancelled' FROM moved UNION ALL SELECT 'asked' FROM asked"
            " UNION ALL SELECT NULL FROM told WHERE w < 0 OR c < 0")

    # --- limits (0007_flow_control.sql) ----------------------------------------------------

    @cached_property
    def flow_usage(self) -> Statement:
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

    @cached_property
    def queue_pause(self) -> Statement:
        # Returns the row whether it was paused now or already: pausing twice is not an error.
        return _q(
            "WITH added AS (INSERT INTO {s}.paused_queues (queue) VALUES (%(queue)s)"
            "   ON CONFLICT (queue) DO NOTHING RETURNING paused_at)"
            " SELECT paused_at, true FROM added"
            " UNION ALL SELECT paused_at, false FROM {s}.paused_queues"
            "   WHERE queue = %(queue)s AND NOT EXISTS (SELECT FROM added)",
            self.schema,
        )

    @cached_property
    def queue_resume(self) -> Statement:
        # Wakes the queue's workers, as an enqueue does: they claim at once, not at their poll.
        return _q(
            "WITH removed AS (DELETE FROM {s}.paused_queues WHERE queue = %(queue)s"
            "   RETURNING queue)"
            " SELECT count(*), (SELECT count(*) FROM (SELECT pg_notify(%(channel)s,"
            "   json_build_object('queue', queue, 'run_at', extract(epoch FROM now()),"
            # No row became queued: nothing to lower a floor for (_worker/floors.py).
            "   'lanes', '[]'::json)::text)"
            "   FROM removed) n) FROM removed",
            self.schema,
        )

    # Every claim reads paused_queues, so it holds an AccessShareLock on it until it commits;
    # its locks are taken before its snapshot. The transactions holding one right after a
    # pause committed are the claims that may not have seen it (Queue.pause waits them out).
    # pg_locks, not pg_stat_activity: any role may read it, whatever the application name.
    @cached_property
    def paused_queues_lockers(self) -> Statement:
        return self._on_paused_queues(
            "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{{}}') FROM pg_locks"
            " WHERE relation = {t} AND pid <> pg_backend_pid()")

    @cached_property
    def paused_queues_lockers_left(self) -> Statement:
        return self._on_paused_queues(
            "SELECT count(*) FROM pg_locks WHERE relation = {t}"
            " AND virtualtransaction = ANY(%(vxids)s::text[])")

    def _on_paused_queues(self, template: str) -> Statement:
        table = sql.Identifier(self.schema, "paused_queues").as_string(None)
        return sql.SQL(template).format(t=sql.SQL("{}::regclass").format(sql.Literal(table)))

    @cached_property
    def queue_paused_list(self) -> Statement:
        return _q("SELECT queue, paused_at FROM {s}.paused_queues ORDER BY queue", self.schema)
