"""What every role's statements share: column lists and composing helpers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from psycopg import sql

# Columns returned to the worker by a claim, in this order (see fetcher.ClaimedJob).
# trace_context: NULL unless the producer traced (asyncjobq.tracing); pending: NULL unless the
# job has parents (a workflow's, 0012_workflows.sql), whose results the worker then reads.
CLAIM_COLUMNS = (
    "id, task, queue, payload, priority, attempts, max_attempts, run_at, created_at, "
    "trace_context, pending"
)
# Columns of JobInfo, in this order, as the live table has them (a live job has no result).
INFO_COLUMNS = (
    "id, task, queue, status, attempts, max_attempts, priority, run_at, last_error, "
    "created_at, finished_at, payload, key, NULL::jsonb, progress, "
    "cancel_requested_at IS NOT NULL"
)
# The same columns as jobs_history has them.
HISTORY_INFO_COLUMNS = (
    "id, task, queue, status, attempts, max_attempts, priority, run_at, last_error, "
    "created_at, finished_at, payload, key, result, progress, false"
)
# Columns shared by jobs and jobs_history, for moving a finished row.
HISTORY_COLUMNS = (
    "id, queue, task, payload, status, priority, run_at, attempts, max_attempts, "
    "dedup_key, locked_by, last_error, created_at, finished_at, key, progress"
)


def history_row(status: str, *, status_sql: str | None = None,
                last_error: str = "last_error") -> str:
    """The SELECT list (HISTORY_COLUMNS' order) that moves a `jobs` row deleted by the same
    statement into jobs_history as `status`, finished now: one list for every statement that
    finishes jobs, so a column added to both tables is added once. `status_sql` and
    `last_error`: SQL expressions to use instead (a status per row, an error appended)."""
    status_sql = status_sql or f"'{status}'"
    return (f"id, queue, task, payload, {status_sql}, priority, run_at,"
            f" attempts, max_attempts, dedup_key, locked_by, {last_error}, created_at, now(),"
            " key, progress")


def notify_waited(rows: str) -> str:
    """A scalar subquery that notifies <schema>_done (%(done)s) of each row of `rows` (id and
    waited columns: jobs this statement made final) that a `Queue.wait` looks for
    (0011_results.sql); the count sent. Rows nobody waits for send nothing."""
    return (f"(SELECT count(pg_notify(%(done)s, w.id::text)) FROM {rows} w"
            " WHERE w.waited)")


# Every insert of ours names the generation its rows go to (docs/how-it-works/storage.md): the
# column's default, current_gen(), is a SQL function that PostgreSQL runs (and plans) for each
# row, about 40 µs of server CPU in a one-row enqueue of 270; an uncorrelated subquery is one
# InitPlan a statement. The same snapshot reads it either way. Producers thus need version 13.
GEN = "(SELECT gen FROM {s}.generation)"


# The shard a statement counts into: its backend's, moved on by one every second. Two
# backends stay apart as before (their distance is kept), and each row is written by every
# backend in turn: a row updated in place by one backend's every statement kept each old
# version under a pinned xmin horizon, and the upsert's probe of its key read them all
# (311 to 1,117 us after 50,000 versions; a shard a second stays flat), which is what slowed
# the claim of a worker pinned for 30 minutes (benchmarks/results/PINNED.md).
HISTORY_SHARD = "1 + mod(pg_backend_pid() + extract(epoch FROM now())::bigint, 64)"


def count_history(rows: str) -> str:
    """The body of a data-modifying CTE that adds the rows of `rows` (queue and status columns:
    the rows this statement inserted into jobs_history) to history_counts, in one shard
    (HISTORY_SHARD) and in key order, as the trigger did before 0010_history_counted.sql (two
    writers lock their rows in one order: no deadlock). Every statement that inserts into
    jobs_history includes it."""
    return ("INSERT INTO {s}.history_counts AS c (queue, status, shard, n)"
            f" SELECT queue, status, {HISTORY_SHARD}, count(*)"
            f" FROM {rows} GROUP BY queue, status ORDER BY queue, status"
            " ON CONFLICT (queue, status, shard) DO UPDATE SET n = c.n + excluded.n")


# Sessions of this database holding the xmin horizon back, and since when: one with a
# transaction id since its transaction began; one with only a snapshot, since its transaction
# began when idle in it (REPEATABLE READ keeps its snapshot) and since its statement began while
# it runs one (READ COMMITTED takes a snapshot per statement). VACUUMs are left out: their xmin
# holds nothing back. Sessions of roles whose activity this one may not see are not in it
# (pg_read_all_stats shows them).
HORIZON_HOLDERS = (
    "SELECT CASE WHEN a.backend_xid IS NOT NULL OR a.state <> 'active' THEN a.xact_start"
    "  ELSE a.query_start END AS since FROM pg_stat_activity a"
    " WHERE a.datname = current_database() AND a.backend_type = 'client backend'"
    "   AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)"
    "   AND a.pid <> pg_backend_pid()"
    "   AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum v)")


def notify_lanes(rows: str) -> str:
    """A scalar subquery that notifies %(channel)s of the rows of `rows` (any relation with
    queue, priority and run_at: rows this statement made queued), through the schema's
    notify_lanes() (0009_notify_lanes.sql): one notification per queue, naming each lane's
    earliest run_at, so that a worker lowers its floors there (_worker/floors.py). Every
    statement that makes rows queued, but an INSERT (jobs_notify, or the batch's own
    notification of its one lane, sql/enqueue.py), includes it;
    it returns the notifications sent (NULL for no row)."""
    return ("(SELECT {s}.notify_lanes(%(channel)s, array_agg(queue), array_agg(priority),"
            f" array_agg(run_at)) FROM {rows})")


@dataclass(frozen=True)
class IndexDefinition:
    """An index as a migration creates it: `CREATE [UNIQUE] INDEX name ON table definition`,
    where `definition` ([USING method] (columns) [WHERE predicate]) names only columns."""

    name: str
    table: str
    unique: bool
    definition: str


# What a statement property returns: what psycopg's execute() takes.
Statement = sql.SQL | sql.Composed

# A quoted literal or identifier: its spaces are its own.
_QUOTED = re.compile(r"""('(?:[^']|'')*'|"(?:[^"]|"")*")""")


def rendered(statement: sql.Composable) -> sql.SQL:
    """The statement as one piece of SQL text, rendered once, with runs of whitespace outside
    quotes made one space. A Composed is rendered again at every execute (the schema's
    identifier escaped each time), and psycopg converts a statement's placeholders once per
    text only up to 4,096 bytes (psycopg/_queries.py, MAX_CACHED_STATEMENT_LENGTH): the worker's
    longest statements were parsed anew on every claim."""
    parts = _QUOTED.split(statement.as_string(None))
    return sql.SQL("".join(p if i % 2 else re.sub(r"\s+", " ", p)
                           for i, p in enumerate(parts)).strip())


def _q(template: str, schema: str) -> sql.SQL:
    """Fill `{s}` with the schema identifier; everything else in the template is literal SQL."""
    return rendered(sql.SQL(template).format(s=sql.Identifier(schema)))


def _advisory_xact_lock(key: str, *, wait: bool) -> Statement:
    # Transaction-scoped, so a crashed holder can never leave it taken.
    fn = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    return sql.SQL("SELECT {}(hashtext({}))").format(sql.SQL(fn), sql.Literal(key))


class Role:
    """Statements of one role; Statements (this package) puts the roles together."""

    schema: str
    # The worker's flush for batches of which outcomes (claim.py: ANY_OUTCOMES, PLAIN_OUTCOMES,
    # DONE_OUTCOMES, LOCKED_DONE_OUTCOMES).
    outcomes: int = 0
    # The partition of jobs the worker's claims and completions name (`{j}`): jobs_<part>,
    # the generation they read (0013_generations.sql); None: jobs itself, every partition.
    part: int | None = None

    def _compose(self, template: str) -> sql.SQL:
        # Our own names, written as the templates write `jobs` (unquoted).
        table = "jobs" if self.part is None else f"jobs_{int(self.part)}"
        return rendered(sql.SQL(template).format(
            s=sql.Identifier(self.schema), c=sql.SQL(CLAIM_COLUMNS), h=sql.SQL(HISTORY_COLUMNS),
            j=sql.SQL(table)))
