"""`asyncjobq doctor`'s statements: its read-only health checks, and the fixes it advises.

The claim as doctor prepares and explains it is not here but in claim.py, next to the
statement workers run, which it must stay.
"""

from __future__ import annotations

from functools import cached_property

from psycopg import sql

from .common import IndexDefinition, Role, Statement, _q


class DoctorStatements(Role):
    # --- read-only health checks -------------------------------------------------------------

    @cached_property
    def doctor_set_local_timeouts(self) -> sql.SQL:
        return sql.SQL("SET LOCAL lock_timeout = '1s'; SET LOCAL statement_timeout = '10s'")

    @cached_property
    def doctor_server(self) -> sql.SQL:
        return sql.SQL(
            "SELECT current_setting('server_version'), current_setting('autovacuum'),"
            "  current_setting('track_counts'), pg_notification_queue_usage()"
        )

    @cached_property
    def server_now(self) -> sql.SQL:
        return sql.SQL("SELECT now()")

    @cached_property
    def doctor_table_stats(self) -> Statement:
        # Tuple counts come from the statistics collector: estimates, flushed about once a second.
        return sql.SQL(
            "SELECT c.relname, coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0),"
            "  pg_table_size(c.oid), pg_indexes_size(c.oid),"
            "  s.last_vacuum, s.last_autovacuum, s.last_analyze, s.last_autoanalyze,"
            "  coalesce(s.autovacuum_count, 0), coalesce(c.reloptions, '{{}}')"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid"
            # jobs' rows are in its partitions, one per generation (0013_generations.sql).
            " WHERE n.nspname = {schema} AND c.relkind = 'r'"
            "   AND c.relname IN ('jobs_0', 'jobs_1', 'jobs_history')"
            " ORDER BY c.relname"
        ).format(schema=sql.Literal(self.schema))

    @cached_property
    def doctor_generations(self) -> Statement:
        # The current generation of jobs, its switches and the last one's time, the server's
        # clock (0013_generations.sql, _maintenance/rotation.py).
        return _q("SELECT gen, switches, switched_at, now() FROM {s}.generation", self.schema)

    @cached_property
    def doctor_index_stats(self) -> Statement:
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

    @cached_property
    def job_count_stale_running(self) -> Statement:
        return _q(
            "SELECT count(*), extract(epoch FROM now() - min(locked_at)) FROM {s}.jobs"
            " WHERE status = 'running' AND locked_at < now() - make_interval(secs => %(lease)s)",
            self.schema,
        )

    @cached_property
    def doctor_waiting_stranded(self) -> Statement:
        # Waiting jobs (0012_workflows.sql) that no parent will release: none of their edges
        # still to apply leads to a job that can end. The triggers leave none; a TRUNCATE of
        # jobs (no row trigger fires) or edges deleted by hand do.
        return _q(
            "SELECT count(*), (array_agg(c.id ORDER BY c.id))[1:20] FROM {s}.jobs c"
            " WHERE c.status = 'waiting' AND NOT EXISTS ("
            "  SELECT FROM {s}.job_deps d JOIN {s}.jobs p ON p.id = d.parent_id"
            "  WHERE d.child_id = c.id AND d.ended IS NULL"
            "    AND p.status IN ('waiting', 'queued', 'running'))",
            self.schema,
        )

    @cached_property
    def doctor_history_counts_drift(self) -> Statement:
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

    @cached_property
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

    @cached_property
    def doctor_prepared_xacts(self) -> sql.SQL:
        return sql.SQL(
            "SELECT gid, extract(epoch FROM now() - prepared), age(transaction)"
            " FROM pg_prepared_xacts WHERE database = current_database()"
            "   AND prepared < now() - make_interval(secs => %(age)s)"
        )

    @cached_property
    def doctor_replication_slots(self) -> sql.SQL:
        return sql.SQL(
            "SELECT slot_name, active, greatest(age(xmin), age(catalog_xmin))"
            " FROM pg_replication_slots WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL"
        )

    @cached_property
    def queue_list_queued(self) -> Statement:
        return _q("SELECT DISTINCT queue FROM {s}.jobs WHERE status = 'queued' ORDER BY 1",
                  self.schema)

    # --- the fixes it advises (shown to the user, never run by asyncjobq) --------------------

    def index_create_concurrently(self, index: IndexDefinition) -> Statement:
        # CONCURRENTLY: a plain CREATE INDEX holds a SHARE lock on the table for the whole
        # build, stopping every claim, completion and heartbeat (past the lease, the reaper
        # then requeues healthy running jobs). One statement, schema-qualified, since
        # CONCURRENTLY refuses to run in a transaction, which a multi-statement string is.
        return sql.SQL("CREATE {unique}INDEX CONCURRENTLY {name} ON {s}.{table} {definition}"
                       ).format(unique=sql.SQL("UNIQUE " if index.unique else ""),
                                name=sql.Identifier(index.name), s=sql.Identifier(self.schema),
                                table=sql.Identifier(index.table),
                                definition=sql.SQL(index.definition))

    def index_create_partitioned(self, index: IndexDefinition) -> Statement:
        # On jobs, partitioned: CONCURRENTLY is refused there, and not needed once each
        # partition has its own index of the same definition: this only attaches them.
        return sql.SQL("CREATE INDEX {name} ON {s}.{table} {definition}").format(
            name=sql.Identifier(index.name), s=sql.Identifier(self.schema),
            table=sql.Identifier(index.table), definition=sql.SQL(index.definition))

    def index_drop_concurrently(self, index: str) -> Statement:
        return sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {s}.{name}").format(
            s=sql.Identifier(self.schema), name=sql.Identifier(index))

    def index_reindex_concurrently(self, index: str) -> Statement:
        return sql.SQL("REINDEX INDEX CONCURRENTLY {s}.{name}").format(
            s=sql.Identifier(self.schema), name=sql.Identifier(index))

    @cached_property
    def history_counts_recount(self) -> Statement:
        # The doctor's advice for a drift (shown, never run by asyncjobq): the lock holds
        # history's writers back until the new counts commit, as the migration's backfill.
        return _q(
            "BEGIN; LOCK TABLE {s}.jobs_history IN SHARE ROW EXCLUSIVE MODE;"
            " TRUNCATE {s}.history_counts;"
            " INSERT INTO {s}.history_counts (queue, status, shard, n)"
            " SELECT queue, status, 0, count(*) FROM {s}.jobs_history GROUP BY 1, 2; COMMIT",
            self.schema,
        )
