"""Where the server's time goes in the worker's flush: its statement replayed in one backend.

    .venv/bin/python -m benchmarks.statement_cost [--jobs 20000] [--batch 10]
        [--variants base,no-browse-indexes,no-count,...] [--done-only] [--floors]

Each variant gets a schema of its own, installed, changed as the variant says (an index or a
trigger dropped, a part of the statement left out) and filled with `--jobs` queued jobs. Then,
on one connection per variant that plans as a worker does, the flush that writes a batch of
`done` outcomes and claims the next batch (`job_set_outcome_if_running_many_then_claim_one_queue`,
or its claim from floors with `--floors`, reading the next floors one time in PEEK_EVERY) runs
until the jobs are gone, the variants interleaved 25 flushes at a time, a VACUUM of the
partition every 100. The figure is the backend's own CPU (/proc/<pid>/schedstat) per job: no
worker process, no other statement, and the machine's drift shared by every variant. `base`
twice (`base`, `base-again`) shows the noise (within 0.5 µs here).

`base` is the flush for done outcomes and failures (PLAIN_OUTCOMES, `_db/sql/claim.py`), which
the other variants change; `done-only` is the one a worker sends for a batch of done outcomes
alone (DONE_OUTCOMES: no UPDATE of rows that stay, no notification of requeued ones).

Needs $ASYNCJOBQ_DSN, a server on this machine (its backends' /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from asyncjobq._db.sql import statements
from asyncjobq._db.sql.claim import DONE_OUTCOMES, LOCKED_DONE_OUTCOMES, PLAIN_OUTCOMES
from asyncjobq._db.sql.common import HISTORY_SHARD
from asyncjobq._worker.floors import PEEK_EVERY

from .common import Server, drop_schema, enqueue_bulk, fresh_schema, install_schema, start_server

CHUNK = 25  # flushes per variant before the next one's turn
VACUUM_EVERY = 4  # chunks


@dataclass
class Variant:
    name: str
    patch: str = ""  # SQL run after install ({s}: the schema)
    edit: Callable[[str], str] = lambda text: text  # a change to the statement's text
    outcomes: int = PLAIN_OUTCOMES  # the flush's shape (_db/sql/claim.py)


def _cut(start: str, *ends: str) -> Callable[[str], str]:
    """Leaves out the text from `start` to the first of `ends` found after it."""
    def edit(text: str) -> str:
        i = text.find(start)
        j = min((k for k in (text.find(e, i) for e in ends) if k >= 0), default=-1)
        if i < 0 or j < 0:
            raise SystemExit(f"the statement has no {start!r}...{ends[0]!r}: this variant does "
                             "not apply to it")
        return text[:i] + " " + text[j:]
    return edit


def _append_count(text: str) -> str:
    """The history count appended to a table without an index (one row per queue and status
    a flush), as a ledger a leader would fold, instead of upserted into history_counts."""
    i = text.find("INSERT INTO ", text.find(" counted AS ("))
    j = text.find(" ON CONFLICT", i)
    k = text.find(")", text.find("excluded.n", j))
    head = text[i:j]
    schema = head.split("INSERT INTO ")[1].split(".")[0]
    head = head.replace(f"{schema}.history_counts AS c (queue, status, shard, n)",
                        f"{schema}.history_count_log (queue, status, n)")
    head = head.replace(f"SELECT queue, status, {HISTORY_SHARD}, count(*)",
                        "SELECT queue, status, count(*)")
    head = head.replace(" ORDER BY queue, status", "")
    return text[:i] + head + text[k:]


def _drop(kind: str, *names: str) -> str:
    on = " ON {s}.jobs" if kind == "TRIGGER" else ""
    return "".join(f"DROP {kind} {'' if on else '{s}.'}{n}{on};" for n in names)


VARIANTS = {v.name: v for v in [
    Variant("base"), Variant("base-again"),
    Variant("no-browse-indexes", _drop("INDEX", "jobs_history_queue_browse_idx",
                                       "jobs_history_task_browse_idx")),
    Variant("no-queue-browse-index", _drop("INDEX", "jobs_history_queue_browse_idx")),
    Variant("no-history-brin", _drop("INDEX", "jobs_history_finished_brin")),
    Variant("no-partial-indexes", _drop(
        "INDEX", "jobs_failed_id_idx", "jobs_failed_browse_idx", "jobs_flow_running_idx",
        "jobs_key_queued_idx", "jobs_key_retrying_idx", "jobs_dedup_idx")),
    Variant("no-key-triggers", _drop("TRIGGER", "jobs_key_insert", "jobs_key_update",
                                     "jobs_key_delete")),
    Variant("no-row-triggers", _drop(
        "TRIGGER", "jobs_key_insert", "jobs_key_update", "jobs_key_delete",
        "jobs_parent_ended_delete", "jobs_parent_ended_failed")),
    Variant("no-delete-triggers", _drop("TRIGGER", "jobs_parent_ended_delete",
                                        "jobs_key_delete")),
    Variant("no-update-triggers", _drop("TRIGGER", "jobs_key_update",
                                        "jobs_parent_ended_failed")),
    # The key's UPDATE trigger as version 13 had it: a BEFORE one to take the key, an AFTER
    # one to free it (0013_generations.sql); 0014_key_trigger.sql made them one.
    Variant("split-update-triggers", _drop("TRIGGER", "jobs_key_update") + (
        "CREATE TRIGGER jobs_key_requeue BEFORE UPDATE OF status, finished_at ON {s}.jobs"
        " FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL AND OLD.status::text NOT IN"
        " ('queued', 'running') AND NEW.status::text IN ('queued', 'running'))"
        " EXECUTE FUNCTION {s}.jobs_key_follow();"
        "CREATE TRIGGER jobs_key_end AFTER UPDATE OF status, finished_at ON {s}.jobs"
        " FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL AND OLD.status::text IN"
        " ('queued', 'running') AND NEW.status::text NOT IN ('queued', 'running'))"
        " EXECUTE FUNCTION {s}.jobs_key_follow();")),
    # The key's triggers with version 14's WHEN clauses, which tested the statuses too
    # (0015_key_when.sql cut them to the key's presence; its function tests the rest).
    Variant("status-when", _drop("TRIGGER", "jobs_key_insert", "jobs_key_update",
                                 "jobs_key_delete") + (
        "CREATE TRIGGER jobs_key_insert BEFORE INSERT ON {s}.jobs FOR EACH ROW WHEN"
        " (NEW.dedup_key IS NOT NULL AND NEW.status::text IN ('queued', 'running'))"
        " EXECUTE FUNCTION {s}.jobs_key_follow();"
        "CREATE TRIGGER jobs_key_update AFTER UPDATE OF status, finished_at ON {s}.jobs"
        " FOR EACH ROW WHEN ((OLD.dedup_key IS NOT NULL AND OLD.status::text IN"
        " ('queued', 'running') AND NEW.status::text NOT IN ('queued', 'running'))"
        " OR (NEW.dedup_key IS NOT NULL AND OLD.status::text NOT IN ('queued', 'running')"
        " AND NEW.status::text IN ('queued', 'running')))"
        " EXECUTE FUNCTION {s}.jobs_key_follow();"
        "CREATE TRIGGER jobs_key_delete AFTER DELETE ON {s}.jobs FOR EACH ROW WHEN"
        " (OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running'))"
        " EXECUTE FUNCTION {s}.jobs_key_follow();")),
    Variant("append-count",
            "CREATE TABLE {s}.history_count_log (queue text, status {s}.job_status, n bigint);",
            edit=_append_count),
    # The done flush that locks its rows first (as the done-only flush was before, and as
    # connections without the workers' plan settings send it).
    Variant("locked-done", outcomes=LOCKED_DONE_OUTCOMES),
    Variant("no-count", edit=_cut(" counted AS (", " updated AS (", " claimed AS (")),
    Variant("done-only", outcomes=DONE_OUTCOMES),
]}


def backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


class Cell:
    def __init__(self, server: Server, variant: Variant, jobs: int, batch: int,
                 floors: bool) -> None:
        self.schema = fresh_schema(server, f"bench_cost_{variant.name.replace('-', '_')}")
        dsn = server.dsn
        asyncio.run(install_schema(dsn, self.schema))
        self.conn = psycopg.connect(dsn, autocommit=True)
        if variant.patch:
            self.conn.execute(variant.patch.format(s=self.schema))
        asyncio.run(enqueue_bulk(dsn, self.schema, jobs))
        self.conn.execute(f"VACUUM ANALYZE {self.schema}.jobs")
        row = self.conn.execute(f"SELECT gen FROM {self.schema}.generation").fetchone()
        self.gen = int(row[0]) if row else 0
        st = statements(self.schema, variant.outcomes, self.gen)
        self.floors = floors
        flush = (st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors
                 if floors else st.job_set_outcome_if_running_many_then_claim_one_queue)
        self.flush = variant.edit(flush.as_string(None))
        self.peek = variant.edit(
            st.job_set_outcome_if_running_many_then_claim_one_queue_from_floors_peek
            .as_string(None)) if floors else ""
        self.conn.execute(st.session_worker_plans)
        row = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.pid = int(row[0])
        self.vacuum = psycopg.connect(dsn, autocommit=True)
        self.params: dict[str, Any] = {
            "worker": "w", "queue": "default", "limit": batch, "channel": self.schema,
            "done": f"{self.schema}_done"}
        self.floor: list[Any] = [None, 0]
        rows = self.conn.execute(st.job_claim_one_queue, self.params).fetchall()
        self.claimed = [(r[0], r[5]) for r in rows]
        self.cpu = 0.0
        self.done = 0
        self.flushes = 0
        self.chunks = 0

    def chunk(self) -> bool:
        """CHUNK flushes; False once no job is left."""
        start = backend_cpu(self.pid)
        for _ in range(CHUNK):
            if not self.claimed:
                break
            self.flushes += 1
            peek = self.floors and self.flushes % PEEK_EVERY == 0
            lanes = json.dumps([["default", 0, self.floor[0], self.floor[1]]])
            outcomes = json.dumps([[i, a, "done", 0, None] for i, a in self.claimed])
            rows = self.conn.execute(self.peek if peek else self.flush,
                                     {**self.params, "lanes": lanes, "outcomes": outcomes},
                                     prepare=True).fetchall()
            self.done += sum(1 for r in rows if r[0] is False)
            self.claimed = [(r[1], r[6]) for r in rows if r[0] is True]
            for r in rows:  # the floors marker row: [[queue, priority, run_at, id]]
                if r[0] is None and r[2] == "floors" and r[4] and r[4][0][2] is not None:
                    self.floor = [r[4][0][2], r[4][0][3]]
        self.cpu += backend_cpu(self.pid) - start
        self.chunks += 1
        if self.chunks % VACUUM_EVERY == 0:
            self.vacuum.execute(f"VACUUM {self.schema}.jobs_{self.gen}")
        return bool(self.claimed)

    def close(self) -> None:
        self.conn.close()
        self.vacuum.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--done-only", action="store_true",
                   help="every variant on the flush of done outcomes alone (DONE_OUTCOMES)")
    p.add_argument("--floors", action="store_true",
                   help="the claim from floors (a worker's while the horizon is held)")
    args = p.parse_args()
    dsn = os.environ.get("ASYNCJOBQ_DSN")
    if not dsn:
        sys.exit("set ASYNCJOBQ_DSN to a server on this machine (its backends' CPU is read "
                 "from /proc)")
    unknown = [n for n in args.variants.split(",") if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    server = start_server()
    shape = (lambda v: replace(v, outcomes=DONE_OUTCOMES)) if args.done_only else (lambda v: v)
    cells = [Cell(server, shape(VARIANTS[n]), args.jobs, args.batch, args.floors)
             for n in args.variants.split(",")]
    try:
        live = cells
        while live:
            live = [c for c in live if c.chunk()]
        base = cells[0].cpu / max(cells[0].done, 1) * 1e6
        print(f"| variant ({args.jobs:,} jobs, batch {args.batch}"
              f"{', from floors' if args.floors else ''}) | server CPU µs/job | vs "
              f"{cells[0].schema.removeprefix('bench_cost_')} |")
        print("|---|---:|---:|")
        for c in cells:
            us = c.cpu / max(c.done, 1) * 1e6
            print(f"| {c.schema.removeprefix('bench_cost_')} | {us:.1f} | {us - base:+.1f} |")
    finally:
        for c in cells:
            c.close()
            drop_schema(server, c.schema)
        server.stop()


if __name__ == "__main__":
    main()
