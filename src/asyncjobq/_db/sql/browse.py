"""Browsing jobs (the dashboard's reads and actions, through Queue): a keyset page of jobs by
filter, counts by filter, one job in full, retry of one job, cancel by filter, throughput per
minute and the workers seen lately.

Filters are composed into the statement only when given (never `%s IS NULL OR col = %s`):
psycopg prepares a statement after a few runs, and a generic plan of an optional filter cannot
pick the index that the filter needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from psycopg import sql

from .common import (
    HISTORY_COLUMNS,
    Role,
    Statement,
    count_history,
    history_row,
    notify_lanes,
    notify_waited,
)

# Columns of JobSummary (job.py), in this order: no payload, the error cut short.
# last_error holds every attempt's error, oldest first (claim.py): the list shows its newest
# 300 characters, the latest attempt's.
SUMMARY_COLUMNS = ("id, task, queue, status, attempts, max_attempts, priority, run_at, "
                   "right(last_error, 300), created_at, finished_at")
# Columns of JobDetail: JobInfo's, then the worker, its lock time and the dedup key.
# JobDetail's: JobInfo's (INFO_COLUMNS, key last), then the worker's.
DETAIL_COLUMNS = ("id, task, queue, status, attempts, max_attempts, priority, run_at, "
                  "last_error, created_at, finished_at, payload, key, {result}, progress, "
                  "{cancel}, locked_by, {locked_at}, dedup_key")


# The statuses a job has while in the live table (jobs); done and cancelled ones are in history.
LIVE_STATUSES = ("waiting", "queued", "running", "failed")

# The statuses asked for, as the enum: compared as text, no index on status could be used.
_STATUSES = "%(statuses)s::text[]::{s}.job_status[]"


def _and(*conditions: tuple[bool, str]) -> sql.SQL:
    return sql.SQL("".join(f" AND {text}" for given, text in conditions if given))


class BrowseStatements(Role):
    def job_page(self, *, queue: bool, task: bool, statuses: Sequence[str]) -> Statement:
        # Newest first, `id < before`. The live table (waiting, queued, running, failed) is read
        # only when one of those statuses is asked for (done and cancelled jobs are never in
        # it), its statuses written as literals so that the planner can use a partial index:
        # failed rows alone through jobs_failed_id_idx, the others by the primary key,
        # backwards.
        # History is read per (queue, status) pair that has rows (from history_counts: a few
        # rows), each branch stopping after `limit` rows, through
        # jobs_history_queue_browse_idx, or jobs_history_task_browse_idx when a task is given.
        # Each branch orders by its index's columns (fixed within the branch, so the order is
        # by id): the primary key cannot give that order, so the planner never walks history
        # backwards by id filtering for a rare pair, which reads all of it when none exist.
        hot = _and((queue, "j.queue = %(queue)s"), (task, "j.task = %(task)s"))
        pairs = _and((queue, "queue = %(queue)s"))
        branch = _and((task, "h.task = %(task)s"))
        order = "h.task DESC, h.queue DESC" if task else "h.queue DESC"
        live = [st for st in statuses if st in LIVE_STATUSES]
        hot_cte: sql.Composable = sql.SQL("")
        hot_part: sql.Composable = sql.SQL("")
        if live:
            hot_cte = sql.SQL(
                "hot AS (SELECT {cols} FROM {s}.jobs j"
                "   WHERE j.status IN ({live}) AND j.id < %(before)s{hot}"
                "   ORDER BY j.id DESC LIMIT %(limit)s),"
            ).format(cols=sql.SQL(SUMMARY_COLUMNS), s=sql.Identifier(self.schema),
                     live=sql.SQL(", ").join(sql.Literal(st) for st in live), hot=hot)
            hot_part = sql.SQL("SELECT * FROM hot UNION ALL ")
        return sql.SQL(
            "WITH {hot_cte}"
            " pairs AS (SELECT queue, status FROM {s}.history_counts"
            "   WHERE status = ANY(%(statuses)s::text[]::{s}.job_status[]){pairs}"
            "   GROUP BY queue, status HAVING sum(n) > 0),"
            " old AS (SELECT h.* FROM pairs p CROSS JOIN LATERAL ("
            "   SELECT {cols} FROM {s}.jobs_history h"
            "   WHERE h.queue = p.queue AND h.status = p.status AND h.id < %(before)s{branch}"
            "   ORDER BY {order}, h.status DESC, h.id DESC LIMIT %(limit)s) h)"
            " SELECT * FROM ({hot_part}SELECT * FROM old) page"
            " ORDER BY id DESC LIMIT %(limit)s"
        ).format(cols=sql.SQL(SUMMARY_COLUMNS), s=sql.Identifier(self.schema),
                 hot_cte=hot_cte, hot_part=hot_part,
                 pairs=pairs, branch=branch, order=sql.SQL(order))

    def job_count(self, *, queue: bool, task: bool, max_id: bool = False) -> Statement:
        # The live table is counted; history is summed from history_counts (exact, a few rows)
        # unless a task is given, which only its index can count. `max_id` (live statuses
        # only: Queue.count_jobs checks) counts the jobs up to that id, as a bulk action's
        # preview shows them.
        hot = _and((queue, "queue = %(queue)s"), (task, "task = %(task)s"),
                   (max_id, "id <= %(max_id)s"))
        pairs = ("SELECT queue, status, sum(n) AS n FROM {s}.history_counts"
                 " WHERE status = ANY(" + _STATUSES + "){pairs} GROUP BY queue, status")
        # With a task, each (queue, status) pair is one range of jobs_history_task_browse_idx.
        old = ("SELECT coalesce(sum((SELECT count(*) FROM {s}.jobs_history h"
               "  WHERE h.task = %(task)s AND h.queue = p.queue AND h.status = p.status)), 0)"
               " FROM (" + pairs + ") p WHERE p.n > 0") if task else (
               "SELECT coalesce(sum(n), 0) FROM (" + pairs + ") p")
        return sql.SQL(
            "SELECT (SELECT count(*) FROM {s}.jobs WHERE status = ANY(" + _STATUSES + "){hot})"
            " + (" + old + ")"
        ).format(s=sql.Identifier(self.schema), hot=hot,
                 pairs=_and((queue, "queue = %(queue)s")))

    @cached_property
    def job_detail_by_id(self) -> Statement:
        return sql.SQL(
            "SELECT {hot} FROM {s}.jobs WHERE id = %(id)s"
            " UNION ALL SELECT {old} FROM {s}.jobs_history WHERE id = %(id)s LIMIT 1"
        ).format(hot=sql.SQL(DETAIL_COLUMNS.format(
                     locked_at="locked_at", result="NULL::jsonb",
                     cancel="cancel_requested_at IS NOT NULL")),
                 old=sql.SQL(DETAIL_COLUMNS.format(
                     locked_at="NULL::timestamptz", result="result", cancel="false")),
                 s=sql.Identifier(self.schema))

    @cached_property
    def job_retry_one(self) -> Statement:
        # As job_retry_failed for one job: not while a live job holds its dedup_key (that
        # would break jobs_dedup_idx); a live job committed after the snapshot raises
        # UniqueViolation, and the caller runs it again.
        return self._compose(
            "WITH requeued AS ("
            " UPDATE {s}.jobs j SET status = 'queued', attempts = 0, run_at = now(),"
            "   finished_at = NULL"
            " WHERE j.id = %(id)s AND j.status = 'failed' AND (j.dedup_key IS NULL"
            "   OR NOT EXISTS (SELECT 1 FROM {s}.jobs o WHERE o.dedup_key = j.dedup_key"
            "     AND o.status IN ('queued', 'running')))"
            " RETURNING j.queue, j.priority, j.run_at)"
            " SELECT queue, " + notify_lanes("requeued") + " FROM requeued")

    def job_cancel_queued(self, *, queue: bool, task: bool, max_id: bool = False,
                          capped: bool = False) -> Statement:
        # `max_id`: only the jobs up to that id (those a bulk action's preview counted);
        # `capped`: only the newest %(limit)s of them (never more than the preview counted). The
        # DELETE checks status again: a job claimed meanwhile is left to run.
        where = sql.SQL("status = 'queued'{f}")
        if capped:
            where = sql.SQL("status = 'queued' AND id IN (SELECT id FROM {s}.jobs"
                            " WHERE status = 'queued'{f} ORDER BY id DESC LIMIT %(limit)s)")
        return sql.SQL(
            "WITH cancelled AS ("
            " DELETE FROM {s}.jobs WHERE {where} RETURNING *),"
            " moved AS (INSERT INTO {s}.jobs_history ({h})"
            " SELECT " + history_row("cancelled") +
            " FROM cancelled RETURNING queue, status),"
            " counted AS (" + count_history("moved") + "),"
            " told AS (SELECT " + notify_waited("cancelled") + " AS w)"
            " SELECT count(*) FROM moved WHERE (SELECT w FROM told) >= 0"
        ).format(s=sql.Identifier(self.schema),
                 h=sql.SQL(HISTORY_COLUMNS),
                 where=where.format(
                     s=sql.Identifier(self.schema),
                     f=_and((queue, "queue = %(queue)s"), (task, "task = %(task)s"),
                            (max_id, "id <= %(max_id)s"))))

    @cached_property
    def throughput_per_minute(self) -> Statement:
        # Done and cancelled from history through its BRIN index on finished_at (the ranges of
        # the last `minutes`); failed ones from the live table through jobs_failed_browse_idx.
        return self._compose(
            "SELECT date_trunc('minute', finished_at) AS minute, queue, status::text, count(*)"
            " FROM {s}.jobs_history"
            " WHERE finished_at > date_trunc('minute', now()) - make_interval(mins => %(m)s)"
            " GROUP BY 1, 2, 3"
            " UNION ALL"
            " SELECT date_trunc('minute', finished_at), queue, 'failed', count(*) FROM {s}.jobs"
            " WHERE status = 'failed'"
            "   AND finished_at > date_trunc('minute', now()) - make_interval(mins => %(m)s)"
            " GROUP BY 1, 2"
            " ORDER BY 1")

    @cached_property
    def workers_seen(self) -> Statement:
        # No table of workers: a worker shows by the jobs it holds (locked_at, renewed by its
        # heartbeat) and the ones it finished lately (BRIN on finished_at). An idle one is not
        # seen; the leader is (leader table).
        return self._compose(
            "SELECT worker, max(seen), sum(running)::bigint FROM ("
            " SELECT locked_by AS worker, max(locked_at) AS seen, count(*) AS running"
            " FROM {s}.jobs WHERE status = 'running' AND locked_by IS NOT NULL GROUP BY 1"
            " UNION ALL"
            " SELECT locked_by, max(finished_at), 0 FROM {s}.jobs_history"
            " WHERE finished_at > now() - make_interval(secs => %(secs)s)"
            "   AND locked_by IS NOT NULL GROUP BY 1"
            " UNION ALL"
            " SELECT worker, now(), 0 FROM {s}.leader WHERE expires_at > now()"
            ") w GROUP BY worker ORDER BY 2 DESC LIMIT 100")
