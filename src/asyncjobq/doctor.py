"""`asyncjobq doctor`: what the queue tables are doing, and what to do about it.

Everything here reads; the one statement that writes (the claim, prepared as workers plan it and
run under EXPLAIN ANALYZE to see its plan and buffers) runs in a transaction always rolled back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from psycopg import sql

from ._db import migrations
from .queue import Queue

OK, WARNING, PROBLEM = "ok", "warning", "problem"

# A clean dequeue index finds the next job in a handful of blocks (the article: 4); hundreds
# means it is wading through entries of rows that are gone (the article: 461).
CLAIM_BLOCKS_PROBLEM = 50
# Autovacuum is set (migrations) to start at 500 + 1 % dead rows; this many more than that
# means it is not running, not keeping up, or blocked by a pinned xmin horizon.
DEAD_TUPLES_MIN = 10_000
# A B-tree entry of the claim index is about 40-60 bytes; far above that per live row is bloat.
INDEX_BYTES_PER_ROW = 64
INDEX_BLOAT_FACTOR = 10
INDEX_BLOAT_MIN_BYTES = 16 * 1024 * 1024
# Below this many live rows the planner may rightly prefer a sequential scan for the claim.
SMALL_TABLE_ROWS = 1000
NOTIFY_QUEUE_WARNING, NOTIFY_QUEUE_PROBLEM = 0.10, 0.50
CLAIM_QUEUES_MAX = 5


@dataclass
class Finding:
    check: str
    level: str
    message: str
    advice: str = ""


@dataclass
class Report:
    schema: str
    server_version: str
    findings: list[Finding] = field(default_factory=list)
    tables: list[dict[str, Any]] = field(default_factory=list)
    indexes: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    xmin_holders: list[dict[str, Any]] = field(default_factory=list)
    notification_queue_usage: float = 0.0

    @property
    def healthy(self) -> bool:
        return not any(f.level == PROBLEM for f in self.findings)

    def add(self, check: str, level: str, message: str, advice: str = "") -> None:
        self.findings.append(Finding(check, level, message, advice))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["healthy"] = self.healthy
        return out


def _ago(ts: datetime | None, now: datetime) -> str:
    if ts is None:
        return "never"
    s = (now - ts).total_seconds()
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else \
        f"{s / 3600:.1f} h ago"


def _mb(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MB"


async def diagnose(queue: Queue, *, lease: float = 30.0, xmin_age: float = 60.0) -> Report:
    """Run every check against the queue's schema and database."""
    st = queue.sql
    qs = queue.schema
    async with queue.connection() as conn:
        await migrations.check(conn, qs)
        cur = await conn.execute(st.doctor_server)
        version, autovacuum, track_counts, notify_usage = await cur.fetchone() or ("", "", "", 0)
        report = Report(qs, str(version), notification_queue_usage=float(notify_usage))
        cur = await conn.execute(st.server_now)
        now = (await cur.fetchone() or (datetime.now(),))[0]

        if autovacuum != "on" or track_counts != "on":
            report.add("autovacuum", PROBLEM,
                       f"server setting autovacuum={autovacuum}, track_counts={track_counts}: "
                       "dead rows of finished jobs are never cleaned up",
                       "set autovacuum = on and track_counts = on in postgresql.conf and "
                       "reload (SELECT pg_reload_conf())")

        live_rows: dict[str, int] = {}
        cur = await conn.execute(st.doctor_table_stats)
        for (table, live, dead, size, idx_size, vac, autovac, analyze, autoanalyze, n_autovac,
             options) in await cur.fetchall():
            live_rows[table] = int(live)
            report.tables.append({
                "table": table, "live_tuples": int(live), "dead_tuples": int(dead),
                "table_bytes": int(size), "indexes_bytes": int(idx_size),
                "last_vacuum": vac, "last_autovacuum": autovac, "last_analyze": analyze,
                "last_autoanalyze": autoanalyze, "autovacuum_count": int(n_autovac),
                "reloptions": list(options)})
            _check_table(report, qs, table, int(live), int(dead), autovac, list(options), now)
        cur = await conn.execute(st.doctor_generations)
        gen_row = await cur.fetchone()
        if gen_row is not None:
            _check_generations(report, qs, gen_row)
        # The claim as workers run it: from the current generation's partition.
        claim_st = queue.database.sql_of(int(gen_row[0]) if gen_row is not None else None)

        expected = migrations.expected_indexes()

        def fix(*statements: sql.Composable) -> str:
            # CONCURRENTLY refuses a transaction, and so a multi-statement string; it builds
            # without blocking claims, completions or heartbeats.
            how = "run outside a transaction" + (", one at a time" if len(statements) > 1
                                                 else "")
            return f"{how}: " + "; then ".join(s.as_string(conn) for s in statements)

        present = set()
        cur = await conn.execute(st.doctor_index_stats)
        for table, index, valid, size, scans in await cur.fetchall():
            present.add(index)
            report.indexes.append({"table": table, "index": index, "valid": bool(valid),
                                   "bytes": int(size), "scans": int(scans),
                                   "bytes_per_live_row": round(size / max(1, live_rows.get(
                                       table, 0)), 1)})
            if valid:
                rebuild = ""
            elif index in expected:
                # REINDEX would rebuild it as it is; dropping and creating it again restores
                # the migrations' definition, whatever the interrupted build was making.
                rebuild = fix(st.index_drop_concurrently(index),
                              st.index_create_concurrently(expected[index]))
            elif _REINDEX_LEFTOVER.search(index):
                rebuild = fix(st.index_drop_concurrently(index))
            else:
                rebuild = fix(st.index_reindex_concurrently(index))
            _check_index(report, qs, index, bool(valid), int(size), live_rows.get(table, 0),
                         rebuild)
        missing = [index for index in sorted(expected) if index not in present]
        # An index of jobs, partitioned, goes with its partitions' (0013_generations.sql):
        # one finding for the three, built on each partition without blocking, then attached.
        with_parent = {_partition_index(index, g) for index in missing
                       if expected[index].table == "jobs" for g in (0, 1)}
        for index in missing:
            definition = expected[index]
            if index in with_parent:
                continue
            if definition.table == "jobs":
                parts = [expected[p] for g in (0, 1)
                         if (p := _partition_index(index, g)) in expected and p not in present]
                advice = fix(*(st.index_create_concurrently(p) for p in parts),
                             st.index_create_partitioned(definition))
            else:
                advice = fix(st.index_create_concurrently(definition))
            report.add("indexes", PROBLEM,
                       f"index {index} on {qs}.{definition.table} is missing"
                       + _WITHOUT_INDEX.get(index, ""), advice)
        if not [f for f in report.findings if f.check == "indexes"]:
            report.add("indexes", OK, f"all {len(expected)} indexes present and valid")

        cur = await conn.execute(st.job_count_stale_running, {"lease": lease})
        stale, oldest = await cur.fetchone() or (0, None)
        if stale:
            report.add("stale running", WARNING,
                       f"{stale} running job(s) not heartbeated for more than {lease:g} s "
                       f"(oldest {float(oldest or 0):.0f} s): their worker is gone",
                       "the leader's reaper requeues them within seconds; if this stays, "
                       "no worker is running on this schema: start one")
        else:
            report.add("stale running", OK, f"no running job older than its {lease:g} s lease")

        cur = await conn.execute(st.doctor_waiting_stranded)
        stranded, first = await cur.fetchone() or (0, None)
        if stranded:
            ids = ", ".join(map(str, first or []))
            report.add("waiting", PROBLEM,
                       f"{stranded} waiting job(s) that no parent will release (ids {ids}"
                       f"{', ...' if stranded > len(first or []) else ''}): their parents "
                       "were removed without ending (a TRUNCATE of jobs, edges deleted by "
                       "hand), or ended while the leader moved the child between generations "
                       "(before schema version 16)",
                       "`python -m asyncjobq get ID` shows how its parents ended: cancel "
                       "it (`python -m asyncjobq cancel ID`), or run it anyway: "
                       + sql.SQL("UPDATE {}.jobs SET status = 'queued', pending = 0"
                                 " WHERE id = ANY(<ids>) AND status = 'waiting'").format(
                                     sql.Identifier(qs)).as_string(conn))
        else:
            report.add("waiting", OK, "every waiting job has a parent still to end")

        cur = await conn.execute(st.doctor_history_counts_drift)
        drift = await cur.fetchall()
        if drift:
            report.add("history counts", PROBLEM,
                       f"stats() and `status` count history wrong for {len(drift)} "
                       "(queue, status): " + ", ".join(
                           f"{q}/{s} says {c} where history holds {h}"
                           for q, s, c, h in drift[:5]) + (", ..." if len(drift) > 5 else "")
                       + " (rows written with triggers disabled, a data-only restore, rows"
                       " inserted by hand, or completed by workers of a release before schema"
                       " version 10 after the upgrade)",
                       "recount them (writers of history wait a second per 10 million rows): "
                       + st.history_counts_recount.as_string(conn))
        else:
            report.add("history counts", OK, "history's counts match its rows")

        await _check_xmin(report, conn, st, xmin_age)

        if notify_usage >= NOTIFY_QUEUE_WARNING:
            report.add("notifications", PROBLEM if notify_usage >= NOTIFY_QUEUE_PROBLEM
                       else WARNING,
                       f"the NOTIFY queue is {notify_usage:.0%} full: at 100 % every enqueue "
                       "fails at commit",
                       "a session that LISTENs is stuck inside a transaction and not reading "
                       "its notifications: find it in pg_stat_activity and end it")
        else:
            report.add("notifications", OK, f"NOTIFY queue {notify_usage:.2%} used")

        paused = {str(q): at for q, at in
                  await (await conn.execute(st.queue_paused_list)).fetchall()}
        queues = [r[0] for r in await (await conn.execute(st.queue_list_queued)).fetchall()]
        held = [q for q in queues if q in paused]
        if held:
            report.add("paused queues", WARNING,
                       "paused with jobs waiting: " + ", ".join(
                           f"{q} (since {paused[q].isoformat(timespec='seconds')})"
                           for q in held),
                       "nothing of theirs is claimed until they are resumed: `python -m "
                       "asyncjobq resume QUEUE` (or `await queue.resume(name)`) if the pause "
                       "is over")
        else:
            report.add("paused queues", OK, "no paused queue has jobs waiting" if not paused
                       else f"paused, no jobs waiting: {', '.join(sorted(paused))}")
        # A paused queue's claim reads nothing (its probe ends it), which says nothing of its
        # index: explain the claims of the queues that run.
        running = [q for q in queues if q not in paused]
        for name in (running or ["default"])[:CLAIM_QUEUES_MAX]:
            report.claims.append(await explain_claim(conn, claim_st, name))
    for claim in report.claims:
        _check_claim(report, qs, claim, live_rows.get("jobs_0", 0) + live_rows.get("jobs_1", 0))
    return report


def _check_generations(report: Report, qs: str, row: Sequence[Any]) -> None:
    """Which partition of jobs is current, and what each holds (0013_generations.sql)."""
    gen, switches, switched_at, now = int(row[0]), int(row[1]), row[2], row[3]
    sizes = {t["table"]: t["table_bytes"] + t["indexes_bytes"] for t in report.tables}
    held = ", ".join(f"{t} {_mb(sizes[t])}" for t in ("jobs_0", "jobs_1") if t in sizes)
    last = f", the last {_ago(switched_at, now)}" if switches else ""
    report.add("generations", OK,
               f"{qs}.jobs_{gen} is current: inserts go there, claims read it; {switches} "
               f"switch(es){last}; {held} (the other one is emptied by TRUNCATE when the "
               "current one grows while a session holds the xmin horizon)")


def _check_table(report: Report, qs: str, table: str, live: int, dead: int,
                 autovac: datetime | None, options: list[str], now: datetime) -> None:
    if "autovacuum_enabled=false" in options:
        report.add("autovacuum", PROBLEM,
                   f"autovacuum is disabled on {qs}.{table}: dead rows accumulate",
                   f"ALTER TABLE \"{qs}\".{table} RESET (autovacuum_enabled)")
    if table in ("jobs_0", "jobs_1") and not any(o.startswith("autovacuum_vacuum_scale_factor=")
                                               for o in options):
        report.add("autovacuum", WARNING,
                   f"{qs}.{table} lacks the queue autovacuum settings the migrations set",
                   f"ALTER TABLE \"{qs}\".{table} SET (autovacuum_vacuum_scale_factor = 0.01, "
                   "autovacuum_vacuum_threshold = 500, autovacuum_vacuum_insert_scale_factor = "
                   "0.01, autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = "
                   "0) (the settings of _db/migrations/0001_init.sql; install does not reapply "
                   "them)")
    if dead > max(DEAD_TUPLES_MIN, live):
        report.add("bloat", PROBLEM,
                   f"{qs}.{table} has {dead} dead rows and {live} live ones; last autovacuum "
                   f"{_ago(autovac, now)}: vacuum is not keeping up or is held back",
                   f"VACUUM (ANALYZE) \"{qs}\".{table}; if a long transaction is listed "
                   "below, end it first or vacuum cannot remove anything")
    else:
        report.add("bloat", OK, f"{qs}.{table}: {live} live, {dead} dead rows, last autovacuum "
                   f"{_ago(autovac, now)}")


def _partition_index(index: str, gen: int) -> str:
    """The name of the partition jobs_<gen>'s index of jobs' index `index`."""
    return f"jobs_{gen}_" + index.removeprefix("jobs_")


# What an interrupted REINDEX CONCURRENTLY leaves beside the index it was rebuilding.
_REINDEX_LEFTOVER = re.compile(r"_cc(new|old)\d*$")


# What the queue does while an index of the migrations is missing or invalid.
_WITHOUT_INDEX = {
    "jobs_dequeue_idx": ": every claim scans the whole table",
}


def _check_index(report: Report, qs: str, index: str, valid: bool, size: int,
                 live: int, rebuild: str) -> None:
    if not valid:
        report.add("indexes", PROBLEM,
                   f"index {qs}.{index} is invalid (an interrupted CREATE/REINDEX "
                   "CONCURRENTLY): the planner ignores it" + _WITHOUT_INDEX.get(index, ""),
                   rebuild)
    elif size > max(INDEX_BLOAT_MIN_BYTES, INDEX_BLOAT_FACTOR * INDEX_BYTES_PER_ROW * live):
        report.add("index size", WARNING,
                   f"index {qs}.{index} is {_mb(size)} for {live} live rows "
                   f"({size // max(1, live)} bytes per row): mostly empty pages",
                   f"REINDEX INDEX CONCURRENTLY \"{qs}\".{index}")


async def _check_xmin(report: Report, conn: Any, st: Any, xmin_age: float) -> None:
    before = len(report.findings)
    cur = await conn.execute(st.doctor_xmin_holders, {"age": xmin_age})
    for pid, user, app, state, age_s, xid_age, query in await cur.fetchall():
        report.xmin_holders.append({"pid": pid, "user": user, "application_name": app,
                                    "state": state, "transaction_age_s": round(float(age_s), 1),
                                    "xid_age": xid_age, "query": query})
        report.add("xmin horizon", PROBLEM,
                   f"pid {pid} ({app or 'no application_name'}, user {user}, {state}) has held "
                   f"a transaction open for {float(age_s):.0f} s: vacuum cannot remove rows "
                   "deleted since, in any table, so the queue tables bloat",
                   f"commit or roll it back in that client, or SELECT pg_terminate_backend({pid})")
    cur = await conn.execute(st.doctor_prepared_xacts, {"age": xmin_age})
    for gid, age_s, _xid_age in await cur.fetchall():
        report.add("xmin horizon", PROBLEM,
                   f"prepared transaction {gid!r} is {float(age_s):.0f} s old and pins the "
                   "xmin horizon", f"COMMIT PREPARED '{gid}' or ROLLBACK PREPARED '{gid}'")
    cur = await conn.execute(st.doctor_replication_slots)
    for slot, active, xid_age in await cur.fetchall():
        if not active:
            report.add("xmin horizon", PROBLEM,
                       f"inactive replication slot {slot!r} holds the xmin horizon "
                       f"({xid_age} transactions back)",
                       f"if nothing will use it again: SELECT pg_drop_replication_slot('{slot}')")
    if len(report.findings) == before:
        report.add("xmin horizon", OK, f"no transaction open longer than {xmin_age:g} s")


async def explain_claim(conn: Any, st: Any, queue_name: str, limit: int = 1) -> dict[str, Any]:
    """The claim statement workers run, its generic plan, under EXPLAIN (ANALYZE, BUFFERS),
    rolled back: its scan, blocks, time."""
    # Prepared, run and dropped in one transaction: behind a transaction pooler the next
    # transaction may be another server connection's. A rollback does not undo PREPARE, and
    # psycopg answers one with DEALLOCATE ALL when it has prepared statements of its own on
    # the connection: look before dropping ours, after a savepoint kept the transaction usable.
    row = None
    async with conn.transaction(force_rollback=True):
        await conn.execute(st.job_claim_one_queue_prepare)
        try:
            async with conn.transaction():
                # Never wait on a lock or run long: this is a look, not a claim.
                await conn.execute(st.doctor_set_local_timeouts)
                await conn.execute(st.doctor_worker_plans_local)
                cur = await conn.execute(
                    st.job_claim_one_queue_explain("asyncjobq-doctor", queue_name, limit))
                row = await cur.fetchone()
        finally:
            if not conn.closed and await (
                    await conn.execute(st.doctor_claim_prepared)).fetchone():
                await conn.execute(st.job_claim_one_queue_deallocate)
    plan = row[0][0] if row else {}
    return _summarise_plan(queue_name, plan)


_PARAMETER = re.compile(r"\$\d")


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out.extend(_nodes(child))
    return out


def _summarise_plan(queue_name: str, plan: dict[str, Any]) -> dict[str, Any]:
    nodes = _nodes(plan.get("Plan", {}))
    # The claim reads the index several times (a descent per priority, then each priority's
    # due rows): its cost is all of those reads together.
    # Workers claim from the current generation's partition (0013_generations.sql): its
    # claim index is jobs_<gen>_dequeue_idx.
    scans = [n for n in nodes if _is_claim_index(n.get("Index Name"))]
    if not scans:  # no claim index: whichever node reads jobs other than by primary key
        scans = [next((n for n in nodes if str(n.get("Relation Name")).startswith("jobs")
                       and not str(n.get("Index Name")).endswith("_pkey")
                       and n.get("Node Type") != "ModifyTable"), {})]
    # The node that hands out the claimed rows: the last read of the index in the plan.
    scan = scans[-1]
    hit = sum(int(n.get("Shared Hit Blocks", 0)) for n in scans)
    read = sum(int(n.get("Shared Read Blocks", 0)) for n in scans)
    return {
        "queue": queue_name,
        "scan": scan.get("Node Type", "?"),
        "index": scan.get("Index Name"),
        # A plan made for the parameters' values compares with the literals instead.
        "generic": any(_PARAMETER.search(str(n.get("Index Cond", ""))) for n in scans),
        "blocks": hit + read,
        "blocks_read": read,
        "rows": int(scan.get("Actual Rows", 0)) * int(scan.get("Actual Loops", 1)),
        "execution_ms": round(float(plan.get("Execution Time", 0.0)), 3),
        "planning_ms": round(float(plan.get("Planning Time", 0.0)), 3),
    }


def _is_claim_index(name: object) -> bool:
    return name in ("jobs_dequeue_idx", "jobs_0_dequeue_idx", "jobs_1_dequeue_idx")


def _check_claim(report: Report, qs: str, claim: dict[str, Any], live: int) -> None:
    what = (f"claim on queue {claim['queue']!r}: {claim['scan']}"
            + (f" on {claim['index']}" if claim["index"] else "")
            + f", {claim['blocks']} blocks, {claim['execution_ms']:.2f} ms")
    if not _is_claim_index(claim["index"]) and live >= SMALL_TABLE_ROWS:
        report.add("claim plan", PROBLEM, f"{what}: not using the partial index jobs_dequeue_idx",
                   f"ANALYZE \"{qs}\".jobs; check the 'indexes' finding")
    elif claim["blocks"] > CLAIM_BLOCKS_PROBLEM:
        report.add("claim plan", PROBLEM,
                   f"{what}: a clean index needs under 10; the rest are entries of rows that "
                   "are gone", f"VACUUM \"{qs}\".jobs (end any long transaction first); "
                   f"REINDEX INDEX CONCURRENTLY \"{qs}\".{claim['index'] or 'jobs_dequeue_idx'}"
                   " if it persists")
    else:
        report.add("claim plan", OK, what)
