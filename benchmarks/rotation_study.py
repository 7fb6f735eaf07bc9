"""A study, not the product: does a `jobs` table partitioned by generation and emptied by
TRUNCATE keep the hot path's size bounded under a pinned horizon, and what does it cost?

    .venv/bin/python -m benchmarks.rotation_study --layout plain --rate 2000 --pin 60
    .venv/bin/python -m benchmarks.rotation_study --layout rotated --rate 2000 --pin 60
    .venv/bin/python -m benchmarks.rotation_study --layout rotated --drain 100000   # no pin

Raw SQL in one process, the product's claim shape (`FOR NO KEY UPDATE SKIP LOCKED`, a batch
per statement, finished rows moved to a history table), without its workers:

- `plain`: one `jobs` table, as the product's schema has it.
- `rotated`: `jobs` list-partitioned on `gen`, three partitions; a row's `gen` is the
  insert time's period (`--period` seconds) modulo 3. Every half second a rotator empties the
  partition that will be the next period's: under `lock_timeout`, `LOCK ... ACCESS EXCLUSIVE`,
  give up while it holds a running job, move its queued rows to the current generation, then
  TRUNCATE. Dead versions leave with the file; no vacuum is needed.
- `direct`: as `rotated`, but the claim and the completion name one partition (`jobs_<gen>`),
  the older generations first, a generation found empty tried again after a second.
- `hybrid`: as `rotated`, the completion addressed as in `direct`.
- `union`: the claim one statement over every generation's partition by name, the queue's
  priorities kept across them (union_claim_sql); the completion as in `direct`.
- `current`: two partitions, one of them current (a row of `cur`): inserts go to it, claims
  name it, a completion names the partition its rows were claimed from. When the current
  partition outgrows `--rotate-mb`, the rotator (under `lock_timeout`) locks the other one,
  gives up while it holds a running job, moves its live rows out, TRUNCATEs it, makes it the
  current one and moves the old current's queued rows into it, in one transaction; queued
  rows that reach the old one later (an insert that began before the switch) are moved every
  half second. Every queued row is in one partition, so a claim reads one and keeps the
  queue's order.

Pressure as `benchmarks/pinned.py`'s `idle`: a transaction that wrote a row to a table of its
own sits idle for `--pin` seconds. Figures per phase: finished jobs/s against offered, backlog,
claim statement time (client side), `jobs` size (all partitions and indexes) and dead rows;
for the rotator, how long it held the lock and how often it could not take it.
Writes benchmarks/results/rotation-<layout>-<cell>.json. Uses $ASYNCJOBQ_DSN.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

RESULTS = Path(__file__).resolve().parent / "results"
S = "rotation_study"
TABLE_OPTS = ("autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 500,"
              " autovacuum_vacuum_insert_scale_factor = 0.01,"
              " autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0")
COLUMNS = """
  queue text NOT NULL DEFAULT 'default', task text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'queued', priority int NOT NULL DEFAULT 0,
  run_at timestamptz NOT NULL DEFAULT now(), attempts int NOT NULL DEFAULT 0,
  locked_at timestamptz, created_at timestamptz NOT NULL DEFAULT now()"""
INDEXES = f"""
CREATE INDEX jobs_dequeue_idx ON {S}.jobs (queue, priority DESC, run_at, id)
  WHERE status = 'queued';
CREATE INDEX jobs_running_idx ON {S}.jobs (locked_at) WHERE status = 'running';
CREATE TABLE {S}.history (id bigint PRIMARY KEY, queue text, task text, payload jsonb,
  finished_at timestamptz);
CREATE TABLE public.rotation_study_pin (x int);
"""


def setup_sql(layout: str, period: float) -> str:
    if layout == "current":
        return current_setup_sql()
    head = f"DROP SCHEMA IF EXISTS {S} CASCADE; DROP TABLE IF EXISTS public.rotation_study_pin;"
    head += f"CREATE SCHEMA {S};"
    if layout == "plain":
        return head + f"""
CREATE TABLE {S}.jobs (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, {COLUMNS})
  WITH ({TABLE_OPTS});""" + INDEXES
    parts = "".join(f"""
CREATE TABLE {S}.jobs_{g} PARTITION OF {S}.jobs FOR VALUES IN ({g}) WITH ({TABLE_OPTS});"""
                    for g in range(3))
    return head + f"""
CREATE SEQUENCE {S}.jobs_id_seq;
CREATE FUNCTION {S}.gen_now() RETURNS smallint LANGUAGE sql STABLE
  AS $$ SELECT (floor(extract(epoch FROM now()) / {period})::bigint % 3)::smallint $$;
CREATE TABLE {S}.jobs (id bigint NOT NULL DEFAULT nextval('{S}.jobs_id_seq'),
  gen smallint NOT NULL DEFAULT {S}.gen_now(), {COLUMNS}) PARTITION BY LIST (gen);
{parts}
CREATE INDEX jobs_id_idx ON {S}.jobs (id);""" + INDEXES


def current_setup_sql() -> str:
    parts = "".join(f"""
CREATE TABLE {S}.jobs_{g} PARTITION OF {S}.jobs FOR VALUES IN ({g}) WITH ({TABLE_OPTS});"""
                    for g in range(2))
    return f"""DROP SCHEMA IF EXISTS {S} CASCADE; DROP TABLE IF EXISTS public.rotation_study_pin;
CREATE SCHEMA {S};
CREATE SEQUENCE {S}.jobs_id_seq;
CREATE TABLE {S}.cur (gen smallint NOT NULL);
INSERT INTO {S}.cur VALUES (0);
CREATE FUNCTION {S}.cur_gen() RETURNS smallint LANGUAGE sql STABLE
  AS $$ SELECT gen FROM {S}.cur $$;
CREATE TABLE {S}.jobs (id bigint NOT NULL DEFAULT nextval('{S}.jobs_id_seq'),
  gen smallint NOT NULL DEFAULT {S}.cur_gen(), {COLUMNS}) PARTITION BY LIST (gen);
{parts}
CREATE INDEX jobs_id_idx ON {S}.jobs (id);""" + INDEXES


MOVE = """
WITH m AS (DELETE FROM {S}.jobs_{src} WHERE id IN (
             SELECT id FROM {S}.jobs_{src} WHERE {which} FOR UPDATE SKIP LOCKED)
           RETURNING *)
INSERT INTO {S}.jobs_{dst} (id, gen, queue, task, payload, status, priority, run_at,
                            attempts, locked_at, created_at)
SELECT id, {dst}, queue, task, payload, status, priority, run_at, attempts, locked_at,
       created_at FROM m"""


def claim_sql(layout: str, gen: int | None = None) -> str:
    if gen is not None:   # "direct": one generation's partition, by its name
        return f"""
WITH c AS (SELECT id FROM {S}.jobs_{gen} WHERE queue = 'default' AND status = 'queued'
             AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT %s
             FOR NO KEY UPDATE SKIP LOCKED)
UPDATE {S}.jobs_{gen} j SET status = 'running', locked_at = now(), attempts = attempts + 1
  FROM c WHERE j.id = c.id RETURNING j.id, {gen}"""
    key = "id" if layout == "plain" else "id, gen"
    match = "j.id = c.id" if layout == "plain" else "j.id = c.id AND j.gen = c.gen"
    return f"""
WITH c AS (SELECT {key} FROM {S}.jobs WHERE queue = 'default' AND status = 'queued'
             AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT %s
             FOR NO KEY UPDATE SKIP LOCKED)
UPDATE {S}.jobs j SET status = 'running', locked_at = now(), attempts = attempts + 1
  FROM c WHERE {match} RETURNING j.{key.replace(', ', ', j.')}"""


def union_claim_sql() -> str:
    """`union`: one statement over every generation, each partition named: the best `limit`
    rows of each (locked, SKIP LOCKED), the best `limit` of those in the queue's order, each
    updated in its own partition. The queue's priorities hold across generations; rows locked
    and not picked are free again at the statement's commit."""
    # FOR UPDATE is refused in a UNION's branch: each partition's rows in a CTE of their own.
    locked = ", ".join(
        f"c{g} AS (SELECT {g} AS g, id, priority, run_at FROM {S}.jobs_{g}"
        f" WHERE queue = 'default' AND status = 'queued' AND run_at <= now()"
        f" ORDER BY priority DESC, run_at, id LIMIT %(n)s FOR NO KEY UPDATE SKIP LOCKED)"
        for g in range(3))
    updates = ", ".join(
        f"u{g} AS (UPDATE {S}.jobs_{g} j SET status = 'running', locked_at = now(),"
        f" attempts = attempts + 1 WHERE j.id = ANY(ARRAY(SELECT id FROM pick WHERE g = {g}))"
        f" RETURNING j.id, {g} AS g)" for g in range(3))
    return (f"WITH {locked}, pick AS MATERIALIZED (SELECT g, id FROM (SELECT * FROM c0"
            " UNION ALL SELECT * FROM c1 UNION ALL SELECT * FROM c2) c"
            f" ORDER BY priority DESC, run_at, id LIMIT %(n)s), {updates}"
            " SELECT * FROM u0 UNION ALL SELECT * FROM u1 UNION ALL SELECT * FROM u2")


def complete_sql(layout: str, gen: int | None = None) -> str:
    if gen is not None:
        return f"""
WITH d AS (DELETE FROM {S}.jobs_{gen} WHERE id = ANY(%s) AND status = 'running'
           RETURNING id, queue, task, payload)
INSERT INTO {S}.history SELECT id, queue, task, payload, now() FROM d"""
    gens = "" if layout == "plain" else " AND gen = ANY(%s)"
    return f"""
WITH d AS (DELETE FROM {S}.jobs WHERE id = ANY(%s){gens} AND status = 'running'
           RETURNING id, queue, task, payload)
INSERT INTO {S}.history SELECT id, queue, task, payload, now() FROM d"""


SAMPLE = f"""
SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0),
       coalesce(sum(s.n_dead_tup), 0),
       (SELECT count(*) FROM {S}.jobs WHERE status = 'queued')
FROM (SELECT relid FROM pg_partition_tree('{S}.jobs') UNION SELECT '{S}.jobs'::regclass) t
LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid"""


class Study:
    def __init__(self, dsn: str, a: argparse.Namespace) -> None:
        self.dsn, self.a = dsn, a
        self.stop = asyncio.Event()
        self.stop_pin = asyncio.Event()
        self.phase = "warm"
        self.done = 0
        self.claims: list[tuple[float, float]] = []   # (end time, seconds)
        self.rotations: list[tuple[float, float, int]] = []   # (time, lock held s, moved)
        self.refused = 0
        self.busy = 0
        self.samples: list[dict[str, Any]] = []
        self.cur = 0   # `current`: the partition claims name

    async def produce(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            tick = 0.05
            chunk = max(1, round(self.a.rate * tick))
            rows = [("noop", "{}")] * chunk
            insert = (f"INSERT INTO {S}.jobs (task, payload) "
                      "SELECT * FROM unnest(%s::text[], %s::jsonb[])")
            next_at = time.monotonic()
            while not self.stop.is_set():
                await c.execute(insert, ([t for t, _ in rows], [p for _, p in rows]))
                next_at += chunk / self.a.rate
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

    async def complete_by_gen(self, c: psycopg.AsyncConnection[Any],
                              rows: list[Any]) -> None:
        """Complete claimed (id, gen) rows, one statement per generation, each naming its
        partition (the `direct` completion)."""
        for g in {r[1] for r in rows}:
            await c.execute(complete_sql("direct", g), ([r[0] for r in rows if r[1] == g],))
        self.done += len(rows)

    async def union_claimer(self, until_empty: bool = False) -> None:
        claim = union_claim_sql()
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                rows = await (await c.execute(claim, {"n": self.a.batch})).fetchall()
                self.claims.append((time.time(), time.monotonic() - t0))
                if not rows:
                    if until_empty:
                        return
                    await asyncio.sleep(0.01)
                    continue
                await self.complete_by_gen(c, rows)

    async def direct_claimer(self, until_empty: bool = False) -> None:
        """Claims from one generation's partition at a time, the older first; a
        generation found empty is tried again only after a second (the current
        one always)."""
        claims = {g: claim_sql("direct", g) for g in range(3)}
        empty_at = {g: -1e9 for g in range(3)}
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            while not self.stop.is_set():
                cur = int(time.time() // self.a.period) % 3
                order = [(cur + 1) % 3, (cur + 2) % 3, cur]   # oldest first
                rows: list[Any] = []
                t0 = time.monotonic()
                for g in order:
                    if g != cur and t0 - empty_at[g] < 1.0:
                        continue
                    got = await (await c.execute(claims[g], (self.a.batch - len(rows),))
                                 ).fetchall()
                    if not got:
                        empty_at[g] = t0
                    rows += got
                    if len(rows) >= self.a.batch:
                        break
                t1 = time.monotonic()
                self.claims.append((time.time(), t1 - t0))
                if not rows:
                    if until_empty and all(t0 - e < 1.0 for e in empty_at.values()):
                        return
                    await asyncio.sleep(0.01)
                    continue
                await self.complete_by_gen(c, rows)

    async def current_claimer(self, until_empty: bool = False) -> None:
        claims = {g: claim_sql("direct", g) for g in range(2)}
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                rows = await (await c.execute(claims[self.cur], (self.a.batch,))).fetchall()
                self.claims.append((time.time(), time.monotonic() - t0))
                if not rows:
                    if until_empty:
                        return
                    await asyncio.sleep(0.01)
                    continue
                await self.complete_by_gen(c, rows)

    async def current_rotator(self) -> None:
        size = f"SELECT pg_total_relation_size('{S}.jobs_' || %s::text)"
        async with await psycopg.AsyncConnection.connect(self.dsn) as c:
            while not self.stop.is_set():
                await asyncio.sleep(0.5)
                cur, old = self.cur, 1 - self.cur
                await c.execute(MOVE.format(S=S, src=old, dst=cur, which="status = 'queued'"))
                grown = (await (await c.execute(size, (cur,))).fetchone() or (0,))[0]
                await c.commit()
                if grown < self.a.rotate_mb * 1e6:
                    continue
                t0 = time.monotonic()
                try:
                    await c.execute("SET LOCAL lock_timeout = '50ms'")
                    await c.execute(f"LOCK TABLE {S}.jobs_{old} IN ACCESS EXCLUSIVE MODE")
                except psycopg.errors.LockNotAvailable:
                    await c.rollback()
                    self.refused += 1
                    continue
                running = (await (await c.execute(
                    f"SELECT count(*) FROM {S}.jobs_{old} WHERE status = 'running'"
                )).fetchone() or (0,))[0]
                if running:
                    await c.rollback()
                    self.busy += 1
                    continue
                moved = (await c.execute(MOVE.format(S=S, src=old, dst=cur, which="true"))
                         ).rowcount
                await c.execute(f"TRUNCATE {S}.jobs_{old}")
                await c.execute(f"UPDATE {S}.cur SET gen = {old}")
                moved += (await c.execute(MOVE.format(S=S, src=cur, dst=old,
                                                      which="status = 'queued'"))).rowcount
                await c.commit()
                self.cur = old
                self.rotations.append((time.time(), time.monotonic() - t0, moved))

    async def claimer(self, until_empty: bool = False) -> None:
        layout = self.a.layout
        if layout == "current":
            return await self.current_claimer(until_empty)
        if layout == "direct":
            return await self.direct_claimer(until_empty)
        if layout == "union":
            return await self.union_claimer(until_empty)
        claim, complete = claim_sql(layout), complete_sql(layout)
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                rows = await (await c.execute(claim, (self.a.batch,))).fetchall()
                t1 = time.monotonic()
                self.claims.append((time.time(), t1 - t0))
                if not rows:
                    if until_empty:
                        return
                    await asyncio.sleep(0.01)
                    continue
                if layout == "hybrid":   # claimed through the parent, completed directly
                    await self.complete_by_gen(c, rows)
                    continue
                params: tuple[Any, ...] = ([r[0] for r in rows],)
                if layout == "rotated":
                    params += (sorted({r[1] for r in rows}),)
                await c.execute(complete, params)
                self.done += len(rows)

    async def rotator(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn) as c:
            emptied_for = None
            while not self.stop.is_set():
                await asyncio.sleep(0.5)
                now = time.time()
                period = int(now // self.a.period)
                if emptied_for == period:
                    continue
                target = (period + 1) % 3
                t0 = time.monotonic()
                try:
                    await c.execute("SET LOCAL lock_timeout = '50ms'")
                    await c.execute(f"LOCK TABLE {S}.jobs_{target} IN ACCESS EXCLUSIVE MODE")
                except psycopg.errors.LockNotAvailable:
                    await c.rollback()
                    self.refused += 1
                    continue
                running = (await (await c.execute(
                    f"SELECT count(*) FROM {S}.jobs_{target} WHERE status = 'running'"
                )).fetchone() or (0,))[0]
                if running:
                    await c.rollback()
                    self.busy += 1
                    continue
                cur = await c.execute(f"""
WITH m AS (DELETE FROM {S}.jobs_{target} RETURNING *)
INSERT INTO {S}.jobs (id, gen, queue, task, payload, status, priority, run_at, attempts,
                      locked_at, created_at)
SELECT id, {S}.gen_now(), queue, task, payload, status, priority, run_at, attempts,
       locked_at, created_at FROM m WHERE {S}.gen_now() <> {target}""")
                moved = cur.rowcount
                await c.execute(f"TRUNCATE {S}.jobs_{target}")
                await c.commit()
                self.rotations.append((time.time(), time.monotonic() - t0, moved))
                emptied_for = period

    async def hold_idle(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.dsn) as c:
            await c.execute("INSERT INTO public.rotation_study_pin VALUES (1)")
            await self.stop_pin.wait()
            await c.rollback()

    async def sample(self, c: psycopg.AsyncConnection[Any]) -> None:
        size, dead, queued = (await (await c.execute(SAMPLE)).fetchone()) or (0, 0, 0)
        s = {"t": time.time(), "phase": self.phase, "size": int(size), "dead": int(dead),
             "queued": int(queued), "done": self.done}
        self.samples.append(s)
        print(json.dumps(s), flush=True)

    async def run(self) -> None:
        a = self.a
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            await c.execute(setup_sql(a.layout, a.period))
            tasks = [asyncio.create_task(self.produce())]
            tasks += [asyncio.create_task(self.claimer()) for _ in range(a.claimers)]
            if a.layout == "current":
                tasks.append(asyncio.create_task(self.current_rotator()))
            elif a.layout != "plain":
                tasks.append(asyncio.create_task(self.rotator()))
            pin: asyncio.Task[None] | None = None
            t0 = time.monotonic()
            while True:
                await asyncio.sleep(a.window)
                el = time.monotonic() - t0
                if self.phase == "warm" and el >= a.warm:
                    self.phase = "pinned"
                    pin = asyncio.create_task(self.hold_idle())
                elif self.phase == "pinned" and el >= a.warm + a.pin:
                    self.stop_pin.set()
                    if pin:
                        await pin
                    self.phase = "after"
                elif self.phase == "after" and el >= a.warm + a.pin + a.after:
                    break
                await self.sample(c)
            self.stop.set()
            await asyncio.gather(*tasks)

    async def drain(self) -> dict[str, Any]:
        a = self.a
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            await c.execute(setup_sql(a.layout, a.period))
            await c.execute(f"INSERT INTO {S}.jobs (task, payload) SELECT 'noop', '{{}}'"
                            f" FROM generate_series(1, {a.drain})")
            await c.execute(f"VACUUM ANALYZE {S}.jobs")
            stat = "SELECT sum(xact_commit) FROM pg_stat_database"
            t0 = time.monotonic()
            await asyncio.gather(*(self.claimer(until_empty=True) for _ in range(a.claimers)))
            took = time.monotonic() - t0
            await c.execute(stat)
        return {"args": vars(a), "jobs": self.done, "seconds": round(took, 3),
                "jobs_per_s": round(self.done / took, 1)}

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"args": vars(self.a), "phases": {}}
        for phase in ("warm", "pinned", "after"):
            ps = [x for x in self.samples if x["phase"] == phase]
            if len(ps) < 2:
                continue
            first, last = ps[0], ps[-1]
            ms = sorted(d * 1000 for t, d in self.claims if first["t"] <= t <= last["t"])
            q = statistics.quantiles(ms, n=100)
            rot = [held * 1000 for t, held, _ in self.rotations if first["t"] <= t <= last["t"]]
            out["phases"][phase] = {
                "of_offered": round((last["done"] - first["done"])
                                    / (last["t"] - first["t"]) / self.a.rate, 4),
                "backlog_max": max(x["queued"] for x in ps),
                "claim_ms_p50": round(statistics.median(ms), 3),
                "claim_ms_p99": round(q[98], 3),
                "size_mb_end": round(last["size"] / 1e6, 2),
                "size_mb_max": round(max(x["size"] for x in ps) / 1e6, 2),
                "dead_end": last["dead"],
                "rotations": len(rot),
                "rotation_lock_ms_max": round(max(rot), 2) if rot else None,
                "rotation_lock_ms_median": round(statistics.median(rot), 2) if rot else None,
            }
        out["rotations_refused_lock"] = self.refused
        out["rotations_refused_running"] = self.busy
        out["moved"] = sum(m for *_, m in self.rotations)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", required=True,
                   choices=["plain", "rotated", "direct", "hybrid", "union", "current"])
    p.add_argument("--rate", type=int, default=2000)
    p.add_argument("--claimers", type=int, default=4)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--period", type=float, default=10.0)
    p.add_argument("--warm", type=float, default=20)
    p.add_argument("--pin", type=float, default=60)
    p.add_argument("--after", type=float, default=10)
    p.add_argument("--rotate-mb", type=float, default=8.0,
                   help="`current`: rotate when the current partition outgrows this")
    p.add_argument("--window", type=float, default=2)
    p.add_argument("--drain", type=int, default=0, help="no pin: drain this many jobs")
    p.add_argument("--label", default="")
    a = p.parse_args()
    dsn = os.environ["ASYNCJOBQ_DSN"]
    study = Study(dsn, a)
    if a.drain:
        out = asyncio.run(study.drain())
        cell = f"drain{a.drain}"
    else:
        asyncio.run(study.run())
        out = study.report()
        cell = f"{a.rate}-pin{a.pin:g}"
    RESULTS.mkdir(exist_ok=True)
    name = f"rotation-{a.layout}-{cell}{'-' + a.label if a.label else ''}.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out.get("phases", out), indent=1))


if __name__ == "__main__":
    main()
