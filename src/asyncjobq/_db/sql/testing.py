"""asyncjobq.testing's statements: the throwaway schema of `isolated`, the queued jobs of
`enqueued` and the one-job claim of `drain`."""

from __future__ import annotations

from functools import cached_property

from psycopg import sql

from .common import INFO_COLUMNS, Role, Statement, _q


class TestingStatements(Role):
    # --- the test schema ---------------------------------------------------------------------

    @cached_property
    def search_path_show(self) -> sql.SQL:
        return sql.SQL("SHOW search_path")

    @cached_property
    def local_lock_timeout_5s(self) -> sql.SQL:
        # Set before schema_drop, in its transaction (a pooler would keep a session's SET for
        # its next client), which must not wait forever on a leftover worker's locks.
        return sql.SQL("SET LOCAL lock_timeout = '5s'")

    @cached_property
    def schema_drop(self) -> Statement:
        return _q("DROP SCHEMA IF EXISTS {s} CASCADE", self.schema)

    # --- enqueued, drain ---------------------------------------------------------------------

    @cached_property
    def job_list_queued(self) -> Statement:
        # Due or not, of %(task)s and %(queue)s when not NULL, oldest first.
        return _q(
            "SELECT " + INFO_COLUMNS + " FROM {s}.jobs WHERE status = 'queued'"
            " AND (%(task)s::text IS NULL OR task = %(task)s)"
            " AND (%(queue)s::text IS NULL OR queue = %(queue)s) ORDER BY id",
            self.schema,
        )

    @cached_property
    def job_claim_one_for_drain(self) -> Statement:
        # One job at a time, in the worker's claim order, of %(queues)s (NULL: all), not in a
        # paused queue. Due by the server's clock: %(until)s (a time) and %(ahead)s (seconds
        # from now) only ever add to now(), never hold a due job back.
        return self._compose(
            "UPDATE {s}.jobs SET status = 'running', locked_by = %(worker)s, locked_at = now(),"
            " attempts = attempts + 1"
            " WHERE id = (SELECT id FROM {s}.jobs WHERE status = 'queued'"
            "   AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))"
            "   AND NOT EXISTS (SELECT FROM {s}.paused_queues pq WHERE pq.queue = jobs.queue)"
            "   AND run_at <= greatest(now(), coalesce(%(until)s::timestamptz, now()),"
            "     now() + make_interval(secs => coalesce(%(ahead)s::float8, 0)))"
            "   ORDER BY priority DESC, run_at, id LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED)"
            " RETURNING {c}"
        )
