"""Deployment drills: real PgBouncer in transaction mode, a failover to a promoted streaming
standby, and a worker host cut off from the network (tests/deploy.py starts the parts).

Each drill's figures are printed and, with $ASYNCJOBQ_DRILL_REPORT set, appended to that file
as JSON (docs/guides/deploying.md quotes them).
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import statistics
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest
from conftest import WorkerProcess, run_cli, spawn_worker, wait_for
from deploy import Cluster, Events, Namespace, clusters, pgbouncer, report
from test_limits import peak_overlap

from asyncjobq import ConfigurationError, Queue

pytestmark = [pytest.mark.processes, pytest.mark.drill, pytest.mark.timeout(600)]

APP = "apps.deployapp:queue"
SCHEMA = "deploy"


def start_worker(dsn: str, log: Path, *args: str, prefix: list[str] | None = None,
                 periodic: bool = False) -> WorkerProcess:
    env = {"DEPLOY_LOG": str(log)}
    if periodic:
        env["DEPLOY_PERIODIC"] = "1"
    return spawn_worker(dsn, SCHEMA, *args, app=APP, env=env, prefix=prefix or ())


def stop(procs: list[WorkerProcess], timeout: float = 60) -> list[str]:
    """SIGTERM each worker still running; returns each one's stderr."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except Exception:
            p.kill()
            _, err = p.communicate(timeout=10)
        errs.append(err)
    return errs


async def session_state(direct: str, pooled: str, connections: int) -> list[tuple[object, ...]]:
    """What each of the pooler's server connections carries: `connections` transactions open
    at once through the pooler each hold one of them; each reports its settings, prepared
    statements and LISTEN channels, against a fresh direct connection's."""
    query = ("SELECT current_setting('enable_seqscan'), current_setting('enable_bitmapscan'),"
             " current_setting('plan_cache_mode'),"
             " current_setting('statement_timeout'), current_setting('jit'),"
             " (SELECT count(*) FROM pg_prepared_statements),"
             " (SELECT count(*) FROM pg_listening_channels())")
    async with await psycopg.AsyncConnection.connect(direct, autocommit=True) as conn:
        fresh = await (await conn.execute(query)).fetchone()
    conns = [await psycopg.AsyncConnection.connect(pooled, prepare_threshold=None)
             for _ in range(connections)]
    try:
        rows = [await (await c.execute(query)).fetchone() for c in conns]
        pids = {await (await c.execute("SELECT pg_backend_pid()")).fetchone() for c in conns}
        assert len(pids) == connections  # each its own server connection
    finally:
        for c in conns:
            await c.close()
    return [r for r in rows if r != fresh]


@pytest.mark.parametrize("listen", ["listen_dsn", "poll"])
async def test_pgbouncer_transaction_mode(tmp_path: Path, listen: str) -> None:
    """Producers and 2 workers through PgBouncer in transaction mode (8 server connections
    for them all): 20,000 jobs, a concurrency-limited task, a periodic schedule; every job
    runs once, the limit holds, each tick is enqueued once, no server connection is left
    with a setting, a prepared statement or a LISTEN; pickup latency with and without
    listen_dsn."""
    log = tmp_path / "events.log"
    events = Events(log)
    with clusters() as root:
        primary = Cluster.create(root, "primary")
        primary.start()
        with pgbouncer(primary, pool_size=8) as bouncer:
            q = Queue(bouncer, schema=SCHEMA, pool_max_size=10)
            async with q:
                assert q.database.pooled  # found out by itself
                await q.install()
                extra = ("--listen-dsn", primary.dsn()) if listen == "listen_dsn" else ()
                workers = [start_worker(bouncer, log, "--concurrency", "20", "--lease", "10",
                                        *extra, periodic=True) for _ in range(2)]
                try:
                    started = time.time()
                    ids, dropped = await produce(q)
                    assert len(ids) == 20_000

                    async def finished() -> bool:
                        return len(events.of("end")) - len(events.of("end", "tick")) >= len(ids)
                    await wait_for(finished, timeout=240, interval=0.5,
                                   what="20,000 jobs through PgBouncer")
                    drained = time.time() - started
                    latencies = await pickup(q, events, 20)
                    # Waiting through the pooler: LISTEN on listen_dsn, or reads every 0.5 s.
                    waited = await q.enqueue("work", {"seconds": 0.1})
                    assert (await q.wait(waited, timeout=30)).status == "done"
                    # doctor through the pooler: its look at the claim in one transaction.
                    doctor = run_cli("doctor", "--schema", SCHEMA, dsn=bouncer)
                    # No session lock is held by a server connection between transactions
                    # (the leader's vacuum, which takes one, is off behind a pooler).
                    with psycopg.connect(primary.dsn(), autocommit=True) as conn:
                        advisory = conn.execute(
                            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a"
                            " USING (pid) WHERE l.locktype = 'advisory' AND a.state = 'idle'"
                        ).fetchone()
                finally:
                    errs = stop(workers)
                leftover = await session_state(primary.dsn(), bouncer, 8)
                async with q.connection() as conn:
                    ticks = await (await conn.execute(
                        "SELECT run_at, count(*) FROM deploy.jobs_history WHERE task = 'tick'"
                        " GROUP BY run_at ORDER BY run_at")).fetchall()

    assert doctor.returncode in (0, 1) and "claim plan" in doctor.stdout, (
        doctor.stdout[-3000:], doctor.stderr[-3000:])
    assert "Traceback" not in doctor.stderr
    for err in errs:
        assert "Traceback" not in err, err[-3000:]
        assert "_pg3_" not in err, err[-3000:]  # no statement psycopg prepared
        assert ("polling every" in err) == (listen == "poll"), err[-3000:]
    starts = Counter(e[2] for e in events.of("start") if e[1] != "tick")
    ran, wanted = set(starts), set(ids)
    assert ran == wanted | {i for i in ran if i not in wanted and i > max(ids)}, "lost jobs"
    assert not ran & dropped, "jobs of a rolled-back transaction ran"
    assert max(starts.values()) == 1, [i for i, n in starts.items() if n > 1][:10]
    limited = {e[2]: e[5] for e in events.of("start", "limited")}
    spans = [(limited[e[2]], e[5]) for e in events.of("end", "limited")]
    assert len(spans) == 1000 and peak_overlap(spans) <= 3
    assert ticks and all(n == 1 for _, n in ticks), ticks
    assert leftover == [], leftover
    assert advisory == (0,)
    report(f"pgbouncer-{listen}", jobs=len(ids), workers=2, drain_seconds=round(drained, 1),
           ticks=len(ticks), limited_max_running=peak_overlap(spans),
           pickup_p50_ms=round(statistics.median(latencies) * 1000, 1),
           pickup_max_ms=round(max(latencies) * 1000, 1))


async def produce(q: Queue) -> tuple[list[int], set[int]]:
    """20,000 jobs the ways a service enqueues: one at a time from 20 coroutines, in bulk,
    10 to a transaction of the caller's (and 50 such transactions rolled back), and a
    limited task's. Returns the ids that exist, and those that were rolled back."""
    ids: list[int] = []
    dropped: set[int] = set()

    async def singles(n: int) -> None:
        for _ in range(n):
            ids.append(await q.enqueue("work", {"seconds": 0}))

    async def in_transactions(n: int, commit: bool) -> None:
        for _ in range(n):
            async with q.connection() as conn:
                mine: list[int] = []
                try:
                    async with conn.transaction():
                        for _ in range(10):
                            mine.append(await q.enqueue("work", {"seconds": 0}, conn=conn))
                        if not commit:
                            raise LookupError("roll back")
                except LookupError:
                    dropped.update(mine)
                    continue
                ids.extend(mine)

    await asyncio.gather(*(singles(200) for _ in range(20)),
                         *(in_transactions(25, True) for _ in range(4)),
                         *(in_transactions(25, False) for _ in range(2)))
    for _ in range(28):
        ids.extend(await q.enqueue_many("work", [{"seconds": 0}] * 500))
    ids.extend(await q.enqueue_many("limited", [{"seconds": 0.005}] * 1000))
    return ids, dropped


async def pickup(q: Queue, events: Events, n: int) -> list[float]:
    """Seconds from an enqueue's return to its handler's start, one job at a time, each at a
    random moment (a worker that polls claims a poll interval after its last claim)."""
    out = []
    rng = random.Random(7)
    for _ in range(n):
        await asyncio.sleep(rng.uniform(0.05, 1.0))
        job_id = await q.enqueue("work", {"seconds": 0})
        sent = time.time()

        def started(job_id: int = job_id) -> bool:
            return any(e[2] == job_id for e in events.of("start", "work"))
        await wait_for(started, timeout=30, interval=0.005, what="a job's pickup")
        out.append(next(e[5] for e in events.of("start", "work") if e[2] == job_id) - sent)
    return out


def _one(dsn: str, query: str) -> object:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(query)
        row = cur.fetchone() if cur.description else None
    return row[0] if row else None


async def test_failover_to_promoted_standby(tmp_path: Path) -> None:
    """A primary with a synchronous standby (pg_basebackup, streaming), producers and 2
    workers on a multi-host DSN; the primary stopped -m immediate under load, the standby
    promoted: producers and workers carry on against it by themselves, every id an enqueue
    returned is there, and no job ran twice."""
    log = tmp_path / "events.log"
    events = Events(log)
    with clusters() as root:
        primary = Cluster.create(root, "primary")
        primary.start()
        standby = primary.standby(root, "standby", "standby1")
        standby.start()
        # Set after the base backup, so that the standby does not copy it: promoted, it
        # would wait for a standby of its own at every commit (a failover manager such as
        # Patroni rewrites this setting at promotion).
        _one(primary.dsn(), "ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
        _one(primary.dsn(), "SELECT pg_reload_conf()")
        await wait_for(lambda: _one(primary.dsn(), "SELECT sync_state FROM pg_stat_replication"
                                    " WHERE application_name = 'standby1'") == "sync",
                       timeout=60, what="the standby in synchronous replication")
        multi = (f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} "
                 "dbname=postgres user=postgres target_session_attrs=read-write")
        async with Queue(primary.dsn(), schema=SCHEMA) as setup:
            await setup.install()
        workers = [start_worker(multi, log, "--concurrency", "10", "--lease", "15")
                   for _ in range(2)]
        acked: list[tuple[int, float]] = []
        failures: list[str] = []
        producing = True

        async def producer(q: Queue) -> None:
            while producing:
                try:
                    job_id = await q.enqueue("work", {"seconds": 0.05})
                except Exception as e:  # an enqueue refused while no primary answers
                    failures.append(type(e).__name__)
                    await asyncio.sleep(0.05)
                    continue
                acked.append((job_id, time.time()))
                await asyncio.sleep(0.01)

        tasks: list[asyncio.Task[None]] = []
        try:
            async with Queue(multi, schema=SCHEMA, connect_timeout=5) as q:
                tasks += [asyncio.create_task(producer(q)) for _ in range(4)]
                await wait_for(lambda: len(events.of("end")) >= 200, timeout=60,
                               what="load before the failover")
                stopped = time.time()
                primary.stop("immediate")
                await asyncio.sleep(1)  # what a failover manager takes to decide, at least
                standby.promote()
                promoted = time.time()
                await wait_for(lambda: any(t > promoted for _, t in acked), timeout=60,
                               what="an enqueue on the promoted standby")
                await asyncio.sleep(5)
                producing = False
                await asyncio.wait_for(asyncio.gather(*tasks), 60)
            ids = [i for i, _ in acked]
            new = standby.dsn()

            def drained() -> bool:
                return _one(new, "SELECT count(*) FROM deploy.jobs") == 0
            await wait_for(drained, timeout=120, interval=0.5, what="the rest, on the new primary")
        finally:
            producing = False
            for task in tasks:
                task.cancel()
            errs = stop(workers)
        # Enqueues that return between the stop and the promotion committed before the stop.
        first_enqueue = min(t for _, t in acked if t > promoted) - promoted
        first_start = min(e[5] for e in events.of("start") if e[5] > promoted) - promoted
        first_done = float(str(_one(new, "SELECT extract(epoch FROM min(finished_at))"
                                    " FROM deploy.jobs_history"
                                    f" WHERE finished_at > to_timestamp({promoted})"))) - promoted
        kept = _one(new, "SELECT count(*) FROM deploy.jobs_history WHERE status = 'done'"
                         f" AND id = ANY('{{{','.join(map(str, ids))}}}'::bigint[])")

    for err in errs:
        assert "Traceback" not in err, err[-3000:]
    starts = Counter(e[2] for e in events.of("start"))
    assert kept == len(ids), (kept, len(ids))
    assert set(ids) <= set(starts)
    assert max(starts.values()) == 1, [i for i, n in starts.items() if n > 1][:10]
    report("failover", acked_enqueues=len(ids), failed_enqueue_attempts=len(failures),
           outage_seconds=round(promoted - stopped, 2),
           promotion_to_first_enqueue_s=round(first_enqueue, 2),
           promotion_to_first_claim_s=round(first_start, 2),
           promotion_to_first_completion_s=round(first_done, 2), double_runs=0)


def refused_outcomes(stderr: str) -> int:
    """What the worker's last line says it could not write (worker.py logs it at stop)."""
    found = re.findall(r"stopped: \d+ job\(s\) completed, (\d+) outcome\(s\) refused", stderr)
    assert found, stderr[-3000:]
    return int(found[-1])


async def test_partitioned_worker_host(tmp_path: Path) -> None:
    """Worker A runs in a network namespace, its link to PostgreSQL a veth pair; it holds 12
    jobs, 6 that end during the cut and 6 that would run a minute (lease 6 s). The link is cut for
    3 x lease: A cancels its handlers once its lease has run out, before worker B (on the
    host, leader once A's leadership lapses) reaps and reruns the jobs; when the link is back
    A's outcomes are refused, A claims again, and each job is done once, by B."""
    lease = 6.0
    log = tmp_path / "events.log"
    events = Events(log)
    with Namespace() as ns, clusters() as root:
        primary = Cluster.create(root, "primary", addresses=f"127.0.0.1,{ns.host_address}")
        primary.start()
        async with Queue(primary.dsn(), schema=SCHEMA) as q:
            await q.install()
            # 3 s: past the cut (0.5 s after they start), before A's cut-off (at least
            # lease - lease / 3 = 4 s after it).
            ids = await q.enqueue_many("work", [{"first": 3, "seconds": 0.2}] * 6)
            ids += await q.enqueue_many("work", [{"first": 60, "seconds": 0.2}] * 6)
            a = start_worker(primary.dsn(ns.host_address), log, "--concurrency", "20",
                             "--lease", str(lease), "--name", "drill-a", "--log-level", "info",
                             prefix=ns.prefix())
            workers = [a]
            try:
                await wait_for(lambda: len(events.of("start")) == 12, timeout=60,
                               what="worker A running the 12 jobs")
                a_pid = events.of("start")[0][4]
                b = start_worker(primary.dsn(), log, "--concurrency", "20", "--lease",
                                 str(lease), "--name", "drill-b", "--log-level", "info")
                workers.append(b)
                await asyncio.sleep(0.5)  # B starting, A the leader
                cut = time.time()
                ns.cut()
                try:
                    def rerun() -> bool:
                        return {e[2] for e in events.of("end") if e[4] != a_pid} >= set(ids)
                    try:
                        await wait_for(rerun, timeout=3 * lease, interval=0.1,
                                       what="B running A's jobs while A is cut off")
                    except AssertionError:
                        print(a.stderr_so_far()[-3000:], b.stderr_so_far()[-3000:])
                        raise
                    await asyncio.sleep(max(0.0, cut + 3 * lease - time.time()))
                finally:
                    ns.mend()
                mended = time.time()
                # A's connections back: its held outcomes are written (and refused).
                await wait_for(lambda: "writing outcomes works again" in a.stderr_so_far(),
                               timeout=60, what="A reaching the database again")
                more = await q.enqueue_many("work", [{"seconds": 0.3}] * 200)

                def rejoined() -> bool:
                    return any(e[4] == a_pid and e[2] in more for e in events.of("start"))
                await wait_for(rejoined, timeout=60, what="A claiming again after the cut")
                await wait_for(lambda: {e[2] for e in events.of("end")} >= set(more),
                               timeout=60, what="the jobs after the cut")
                # The handlers' ends are seen before their outcomes' flush commits.
                async def flushed() -> bool:
                    counted = (await q.stats()).get("default", {}).get("done", 0)
                    return bool(counted >= len(ids) + len(more))
                await wait_for(flushed, timeout=30, what="the last outcomes written")
                stats = await q.stats()
                async with q.connection() as conn:
                    rows = await (await conn.execute(
                        "SELECT id, status, locked_by FROM deploy.jobs_history"
                        " WHERE id = ANY(%s)", (ids,))).fetchall()
                    done = (await (await conn.execute(
                        "SELECT count(*) FROM deploy.jobs_history WHERE status = 'done'"
                    )).fetchone())
            finally:
                errs = stop(workers)

    for err in errs:
        assert "Traceback" not in err, err[-3000:]
    by_id = {r[0]: r for r in rows}
    assert sorted(by_id) == sorted(ids)
    assert all(r[1] == "done" and str(r[2]).startswith("drill-b") for r in rows), rows
    assert done is not None and stats["default"]["done"] == done[0] == len(ids) + len(more)
    a_events = [e for e in events.read() if e[4] == a_pid and e[2] in ids]
    ended_in_cut = {e[2] for e in a_events if e[0] == "end" and e[5] > cut}
    cancelled = {e[2]: e[5] for e in a_events if e[0] == "cancelled"}
    assert len(ended_in_cut) == 6 and len(cancelled) == 6, a_events
    # A let go of every job before B started it again.
    b_started = {e[2]: e[5] for e in events.of("start") if e[4] != a_pid and e[2] in ids}
    assert all(cancelled[i] < b_started[i] for i in cancelled), (cancelled, b_started)
    assert refused_outcomes(errs[0]) >= len(ended_in_cut)
    delays = [t - cut for t in cancelled.values()]
    report("partition", lease_s=lease, cut_s=round(mended - cut, 1),
           handlers_cancelled_after_s=[round(min(delays), 2), round(max(delays), 2)],
           b_restarted_after_s=round(min(b_started.values()) - cut, 2),
           a_outcomes_refused=refused_outcomes(errs[0]), done_once=len(ids) + len(more))


async def test_pgbouncer_misconfigured_says_what_to_do(tmp_path: Path) -> None:
    """Told there is no pooler (`--pooler none`), a worker behind PgBouncer in transaction mode
    fails statements with an error that names the setting, rather than hang; a listen_dsn
    that goes through the pooler is refused as the queue opens."""
    log = tmp_path / "events.log"
    with clusters() as root:
        primary = Cluster.create(root, "primary")
        primary.start()
        with pgbouncer(primary, pool_size=4) as bouncer:
            async with Queue(primary.dsn(), schema=SCHEMA) as q:
                await q.install()
                await q.enqueue_many("work", [{"seconds": 0}] * 500)
            with pytest.raises(ConfigurationError, match="goes through a connection pooler"):
                await Queue(bouncer, schema=SCHEMA, listen_dsn=bouncer).open()
            worker = start_worker(bouncer, log, "--pooler", "none", "--concurrency", "20")
            try:
                await wait_for(lambda: "pooler='transaction'" in worker.stderr_so_far(),
                               timeout=60, what="the worker naming the pooler setting")
            finally:
                (err,) = stop([worker])
    assert "Traceback" not in err, err[-3000:]
