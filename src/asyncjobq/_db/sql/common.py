"""What every role's statements share: column lists and composing helpers."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

# Columns returned to the worker by a claim, in this order (see fetcher.ClaimedJob).
# trace_context last: NULL unless the producer traced (asyncjobq.tracing).
CLAIM_COLUMNS = (
    "id, task, queue, payload, priority, attempts, max_attempts, run_at, created_at, "
    "trace_context"
)
# Columns of JobInfo, in this order.
INFO_COLUMNS = (
    "id, task, queue, status, attempts, max_attempts, priority, run_at, last_error, "
    "created_at, finished_at, payload, key"
)
# Columns shared by jobs and jobs_history, for moving a finished row.
HISTORY_COLUMNS = (
    "id, queue, task, payload, status, priority, run_at, attempts, max_attempts, "
    "dedup_key, locked_by, last_error, created_at, finished_at, key"
)


def history_row(status: str) -> str:
    """The SELECT list (HISTORY_COLUMNS' order) that moves a `jobs` row deleted by the same
    statement into jobs_history as `status`, finished now: one list for every statement that
    finishes jobs, so a column added to both tables is added once."""
    return (f"id, queue, task, payload, '{status}', priority, run_at, attempts, max_attempts,"
            " dedup_key, locked_by, last_error, created_at, now(), key")


def notify_lanes(rows: str) -> str:
    """A scalar subquery that notifies %(channel)s once per queue of `rows` (any relation with
    queue, priority and run_at: rows this statement made queued) and counts the notifications.
    Each carries the queue's earliest run_at (when to wake) and, per priority, the earliest
    run_at among them: a worker lowers its floors there (_worker/floors.py). Every statement
    that makes rows queued, but an INSERT (jobs_notify does that one), must include it."""
    return (
        "(SELECT count(*) FROM (SELECT pg_notify(%(channel)s, json_build_object("
        "'queue', l.queue, 'run_at', extract(epoch FROM min(l.at)),"
        # Past 100 lanes the payload would near PostgreSQL's 8,000 bytes: none, and the
        # workers walk the queue's lanes again.
        " 'lanes', CASE WHEN count(*) <= 100 THEN"
        " json_agg(json_build_array(l.priority, extract(epoch FROM l.at))) END)::text)"
        f" FROM (SELECT queue, priority, min(run_at) AS at FROM {rows}"
        " GROUP BY queue, priority) l GROUP BY l.queue) n)")


@dataclass(frozen=True)
class IndexDefinition:
    """An index as a migration creates it: `CREATE [UNIQUE] INDEX name ON table definition`,
    where `definition` ([USING method] (columns) [WHERE predicate]) names only columns."""

    name: str
    table: str
    unique: bool
    definition: str


def _q(template: str, schema: str) -> sql.Composed:
    """Fill `{s}` with the schema identifier; everything else in the template is literal SQL."""
    return sql.SQL(template).format(s=sql.Identifier(schema))


def _advisory_xact_lock(key: str, *, wait: bool) -> sql.Composed:
    # Transaction-scoped, so a crashed holder can never leave it taken.
    fn = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    return sql.SQL("SELECT {}(hashtext({}))").format(sql.SQL(fn), sql.Literal(key))


class Role:
    """Statements of one role; Statements (this package) puts the roles together."""

    schema: str

    def _compose(self, template: str) -> sql.Composed:
        return sql.SQL(template).format(s=sql.Identifier(self.schema), c=sql.SQL(CLAIM_COLUMNS),
                                        h=sql.SQL(HISTORY_COLUMNS))
