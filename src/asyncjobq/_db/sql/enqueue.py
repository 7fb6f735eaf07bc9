"""Enqueue: what producers run (Queue.enqueue, enqueue_many, the inserter)."""

from __future__ import annotations

from functools import cached_property

from .common import GEN, Role, Statement, _q


class EnqueueStatements(Role):

    # A job's run_at from enqueue's run_at (None: now) and delay, in seconds.
    _RUN_AT = "coalesce(%(run_at)s, now()) + make_interval(secs => %(delay)s)"

    # Each insert has a `_traced` twin that also writes trace_context (asyncjobq.tracing): the
    # untraced statements, which producers without tracing run, name no more columns than
    # they need.

    @cached_property
    def job_insert(self) -> Statement:
        return self._job_insert(traced=False)

    @cached_property
    def job_insert_traced(self) -> Statement:
        return self._job_insert(traced=True)

    @cached_property
    def job_insert_keyed(self) -> Statement:
        # enqueue(key=...): the key column exists from schema version 7 on, so only keyed jobs
        # name it (and, to keep the twins few, the trace context too, NULL when untraced).
        return self._job_insert(traced=True, keyed=True)

    def _job_insert(self, *, traced: bool, keyed: bool = False) -> Statement:
        # A live duplicate dedup_key returns the existing job's id (and false: not a new job,
        # for on_enqueued): the insert's trigger inserts no row when a live job holds the key
        # (jobs_key_follow, 0014_key_trigger.sql); when that job was committed after this
        # statement's snapshot, no id comes back and the caller runs it again.
        return _q(
            "WITH ins AS ("
            " INSERT INTO {s}.jobs (task, payload, queue, priority, run_at, max_attempts,"
            "   dedup_key, gen" + (", trace_context" if traced else "")
            + (", key" if keyed else "") + ")"
            " VALUES (%(task)s, %(payload)s, %(queue)s, %(priority)s,"
            "   " + self._RUN_AT + ","
            "   %(max_attempts)s, %(dedup_key)s, " + GEN
            + (", %(trace)s::jsonb" if traced else "")
            + (", %(key)s" if keyed else "") + ")"
            " RETURNING id)"
            " SELECT id, true FROM ins"
            " UNION ALL"
            " SELECT id, false FROM {s}.jobs WHERE dedup_key = %(dedup_key)s"
            "   AND status IN ('queued', 'running') AND NOT EXISTS (SELECT FROM ins)"
            " LIMIT 1",
            self.schema,
        )

    @cached_property
    def job_insert_rows(self) -> Statement:
        return self._job_insert_rows(traced=False)

    @cached_property
    def job_insert_rows_traced(self) -> Statement:
        return self._job_insert_rows(traced=True)

    def _gen(self) -> tuple[str, str]:
        """The generation the rows of a batch insert take, and the condition that guards it.

        Through `jobs` (no `part`), the current one, read by the statement; PostgreSQL then
        routes each row to its partition (about 0.5 µs of server CPU a row, and the routing's
        set-up in each statement). Named (`part`: the producer's guess, PartitionWriter in
        _db/inserter.py), the rows go straight into jobs_<part>, only if that is still the
        current generation: otherwise the statement inserts nothing and returns no row, and
        the producer sends it again for the other one."""
        if self.part is None:
            return GEN, ""
        return f"{int(self.part)}::smallint", f" WHERE {GEN} = {int(self.part)}"

    def _notified(self, insert: str, lane: str) -> str:
        """`insert` (RETURNING id), and, when it names a partition, its notification.

        A statement trigger fires only for the table a statement names: `jobs_notify` of
        `jobs` (0009_notify_lanes.sql) does not see rows inserted into a partition by name.
        Such a batch has one lane (one queue, one priority: PartitionWriter sends the others
        through `jobs`), so the statement sends the trigger's payload itself, built from
        `lane` (SELECT queue AS q, priority AS p, earliest run_at AS at): about 25 µs of
        server CPU less in a one-row insert than the trigger's query over its transition
        table (as a partition's trigger, measured). Only if a row was inserted; in a one-time
        filter, so that the ids alone come back (a second column cost the client more than
        the trigger did the server, in a 100,000-row enqueue_many)."""
        if self.part is None:
            return insert
        return (
            "WITH ins AS (" + insert + ")"
            " SELECT id FROM ins WHERE (SELECT count(pg_notify('" + self.schema + "_jobs',"
            "   json_build_object('queue', l.q, 'run_at', extract(epoch FROM l.at), 'lanes',"
            "   json_build_array(json_build_array(l.p, extract(epoch FROM l.at))))::text))"
            "  FROM (" + lane + ") l WHERE EXISTS (SELECT FROM ins)) >= 0"
        )

    def _job_insert_rows(self, *, traced: bool) -> Statement:
        # Jobs of coalesced enqueue() calls (see inserter), each its own task, queue and
        # schedule: one JSON array of [task, payload, queue, priority, run_at, delay,
        # max_attempts(, trace context)] rows; ids come back in row order. An untraced row in
        # a traced batch has no 8th element: r->7 is NULL.
        # Named, the lane is read back from the rows inserted (the JSON parsed again cost
        # about 2 µs a row).
        gen, guard = self._gen()
        return self._compose(self._notified(
            "INSERT INTO {s}.{j} (task, payload, queue, priority, run_at, max_attempts, gen"
            + (", trace_context" if traced else "") + ")"
            " SELECT r->>0, r->1, r->>2, (r->>3)::int,"
            "   coalesce((r->>4)::timestamptz, now()) + make_interval(secs => (r->>5)::float8),"
            "   (r->>6)::int, " + gen + (", r->7" if traced else "") +
            " FROM jsonb_array_elements(%(rows)s::jsonb) WITH ORDINALITY AS t(r, n)" + guard +
            " ORDER BY n RETURNING id" + (", queue, priority, run_at" if self.part is not None
                                          else ""),
            "SELECT min(queue) AS q, min(priority) AS p, min(run_at) AS at FROM ins"))

    @cached_property
    def job_partitions_insertable(self) -> Statement:
        # Whether batch inserts may name the partitions (_db/inserter.py, PartitionWriter):
        # this role may insert into both and read back what it inserted (RETURNING id, and
        # the lane a batch notifies).
        return self._compose(
            "SELECT count(*) = 2 FROM (VALUES (to_regclass(quote_ident(%s) || '.jobs_0')),"
            "   (to_regclass(quote_ident(%s) || '.jobs_1'))) AS p(t)"
            " WHERE has_table_privilege(p.t, 'INSERT')"
            "   AND has_column_privilege(p.t, 'id', 'SELECT')"
            "   AND has_column_privilege(p.t, 'queue', 'SELECT')"
            "   AND has_column_privilege(p.t, 'priority', 'SELECT')"
            "   AND has_column_privilege(p.t, 'run_at', 'SELECT')"
        )

    @cached_property
    def job_insert_many(self) -> Statement:
        return self._job_insert_many(traced=False)

    @cached_property
    def job_insert_many_traced(self) -> Statement:
        return self._job_insert_many(traced=True)

    # enqueue_many's rows share their queue, priority and schedule: its one lane.
    _MANY_LANE = "SELECT %(queue)s::text AS q, %(priority)s::int AS p, " + _RUN_AT + " AS at"

    @cached_property
    def job_insert_many_keyed(self) -> Statement:
        # enqueue_many(keys=[...]): the keys, a JSON array beside the payloads' (null: no
        # key), zipped by ROWS FROM. The trace context is NULL when untraced.
        gen, guard = self._gen()
        return self._compose(self._notified(
            "INSERT INTO {s}.{j} (task, payload, queue, priority, run_at, max_attempts,"
            "   trace_context, key, gen)"
            " SELECT %(task)s, p, %(queue)s, %(priority)s, " + self._RUN_AT + ","
            "   %(max_attempts)s, %(trace)s::jsonb, k, " + gen +
            " FROM ROWS FROM (jsonb_array_elements(%(payloads)s::jsonb),"
            "   jsonb_array_elements_text(%(keys)s::jsonb))"
            "   WITH ORDINALITY AS t(p, k, n)" + guard + " ORDER BY n"
            " RETURNING id", self._MANY_LANE))

    def _job_insert_many(self, *, traced: bool) -> Statement:
        # One statement for any number of payloads, sent as one JSON array: parsing one
        # document server-side costs far less than a jsonb[] of many (measured ~2x). The
        # traced twin takes the batch's one trace context.
        gen, guard = self._gen()
        return self._compose(self._notified(
            "INSERT INTO {s}.{j} (task, payload, queue, priority, run_at, max_attempts, gen"
            + (", trace_context" if traced else "") + ")"
            " SELECT %(task)s, p, %(queue)s, %(priority)s, " + self._RUN_AT + ","
            "   %(max_attempts)s, " + gen + (", %(trace)s::jsonb" if traced else "") +
            " FROM jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS t(p, n)"
            + guard + " ORDER BY n RETURNING id", self._MANY_LANE))
