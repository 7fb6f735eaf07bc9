-- asyncjobq schema, version 12: workflows, jobs that wait for other jobs
-- (docs/guides/workflows.md, docs/how-it-works/workflows.md).
--
-- A job enqueued with parents is `waiting` until they have ended: not in the claim index (its
-- predicate is status = 'queued'), no attempt spent. job_deps holds one row per edge;
-- jobs.pending counts the child's edges not applied yet, and jobs.dependents marks a job that
-- has children. When a marked job ends, jobs_parent_ended() runs in the transaction that wrote
-- its outcome and applies its edges, each once (job_deps.ended): a parent `done` (or ended
-- otherwise, for a child that runs anyway) takes one off its child's count, and the child
-- whose count reaches 0 becomes `queued` there and then; any other end cancels the child, and
-- its own children in turn. The child's row lock orders two parents ending at once: exactly
-- one of them makes it queued. A job without children never fires the trigger (its WHEN): it
-- costs nothing more to finish.
--
-- The new enum value is used by no expression of this file: a value added in a transaction
-- cannot be used in it (indexes, defaults), only once it commits (function bodies are read
-- when they run).
ALTER TYPE job_status ADD VALUE IF NOT EXISTS 'waiting';

-- Nullable, no default: a catalog change only, no rewrite.
ALTER TABLE jobs ADD COLUMN pending int, ADD COLUMN dependents boolean;

CREATE TABLE job_deps (
  parent_id      bigint  NOT NULL,
  child_id       bigint  NOT NULL,
  -- on_parent_failure="run": the child runs when this parent is dead-lettered or cancelled.
  run_on_failure boolean NOT NULL DEFAULT false,
  -- true once the parent's end was applied to the child: an edge counts once, whatever the
  -- parent does afterwards (a dead-lettered parent retried, then done).
  ended          boolean,
  -- A parent named by id (enqueue(after=[ids])), not enqueued with its child: job_deps_named()
  -- looks at it when the producer's transaction commits.
  named          boolean NOT NULL DEFAULT false,
  PRIMARY KEY (parent_id, child_id)
);
-- A child's parents: `get`, and the parents' results handed to the child (job.parent_results).
CREATE INDEX job_deps_child_idx ON job_deps (child_id);

-- The functions below run with their owner's rights (SECURITY DEFINER): whoever ends a parent
-- or enqueues a workflow needs no grant on job_deps, and a producer adds edges only to the
-- jobs it enqueues. Their search_path is this schema, then pg_temp: a caller's temporary
-- table named like one of ours is never found instead (pg_temp left out of a path is searched
-- first).
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

-- Applies the end of the jobs `frontier` to their children, the edges not applied yet (only
-- the one to `only_child` when given). `how` they ended: their status, or NULL when they
-- were deleted without one. Done, or a child that runs anyway, takes one off the child's
-- count, queued at 0 (its queue's workers notified); the others are cancelled into history,
-- `last_error` naming the parent and how it ended, and their own children are the next
-- round's frontier, cancelled parents. A loop, not a trigger firing for each cancelled
-- child: a chain cancelled thousands deep stays within PostgreSQL's stack. Each statement has
-- a snapshot of its own: it sees the edges of a producer that committed meanwhile.
-- The INSERT into jobs_history lists HISTORY_COLUMNS (src/asyncjobq/_db/sql/common.py): a
-- column added to both tables is added here too.
CREATE FUNCTION job_deps_settle(frontier bigint[], how text, only_child bigint)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  ok boolean := how IS NOT DISTINCT FROM 'done';
  why text := CASE how WHEN 'failed' THEN 'dead-lettered' WHEN 'cancelled' THEN 'cancelled'
                       ELSE 'deleted' END;
  sent int;
  doomed bigint[];
  blamed bigint[];
BEGIN
  LOOP
    WITH e AS (
      UPDATE job_deps d SET ended = true
      WHERE d.parent_id = ANY(frontier) AND d.ended IS NULL
        AND (only_child IS NULL OR d.child_id = only_child)
      RETURNING d.parent_id, d.child_id, d.run_on_failure),
    go AS (
      UPDATE jobs c SET pending = c.pending - g.n,
        status = CASE WHEN c.pending > g.n THEN 'waiting' ELSE 'queued' END::job_status,
        run_at = CASE WHEN c.pending > g.n THEN c.run_at ELSE greatest(c.run_at, now()) END
      FROM (SELECT child_id, count(*)::int AS n FROM e WHERE ok OR run_on_failure
            GROUP BY child_id) g
      WHERE c.id = g.child_id AND c.status::text = 'waiting'
      RETURNING c.queue, c.priority, c.run_at, c.status::text AS status),
    hit AS (
      SELECT child_id, min(parent_id) AS parent_id FROM e WHERE NOT (ok OR run_on_failure)
      GROUP BY child_id ORDER BY child_id)
    -- Workers hear of the children made queued, with their lanes (0009_notify_lanes.sql).
    SELECT (SELECT notify_lanes(current_schema() || '_jobs', array_agg(queue),
                                array_agg(priority), array_agg(run_at)) FROM go WHERE status = 'queued'),
           ARRAY(SELECT child_id FROM hit), ARRAY(SELECT parent_id FROM hit)
      INTO sent, doomed, blamed;
    EXIT WHEN cardinality(doomed) = 0;
    -- The cancelled children's marks are taken off first: their DELETE must not fire the
    -- trigger again (their children are this loop's next round).
    UPDATE jobs c SET dependents = NULL
    WHERE c.id = ANY(doomed) AND c.status::text = 'waiting' AND c.dependents;
    WITH gone AS (
      DELETE FROM jobs c WHERE c.id = ANY(doomed) AND c.status::text = 'waiting'
      RETURNING c.*),
    moved AS (
      INSERT INTO jobs_history (id, queue, task, payload, status, priority, run_at, attempts,
                                max_attempts, dedup_key, locked_by, last_error, created_at,
                                finished_at, key, progress)
      SELECT g.id, g.queue, g.task, g.payload, 'cancelled', g.priority, g.run_at, g.attempts,
             g.max_attempts, g.dedup_key, g.locked_by, format('parent %s was %s', b.parent, why),
             g.created_at, now(), g.key, g.progress
      FROM gone g JOIN unnest(doomed, blamed) AS b(child, parent) ON b.child = g.id
      RETURNING queue, status),
    -- Counted as the statements that write history count (0010_history_counted.sql).
    counted AS (
      INSERT INTO history_counts AS h (queue, status, shard, n)
      SELECT queue, status, 1 + mod(pg_backend_pid(), 64), count(*)
      FROM moved GROUP BY queue, status ORDER BY queue, status
      ON CONFLICT (queue, status, shard) DO UPDATE SET n = h.n + excluded.n)
    -- A Queue.wait on a cancelled child hears of it (0011_results.sql).
    SELECT (SELECT count(pg_notify(current_schema() || '_done', g.id::text)) FROM gone g
            WHERE g.waited),
           ARRAY(SELECT g.id FROM gone g)
      INTO sent, frontier;
    EXIT WHEN cardinality(frontier) = 0;
    ok := false;
    why := 'cancelled';
    only_child := NULL;
  END LOOP;
END
$$;

-- A marked job ended (the triggers below): done or cancelled (moved to history by the
-- statement that deleted it), deleted by hand, or dead-lettered.
CREATE FUNCTION jobs_parent_ended() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  how text;
BEGIN
  IF TG_OP = 'UPDATE' THEN
    how := 'failed';
  ELSE
    SELECT h.status::text INTO how FROM jobs_history h WHERE h.id = OLD.id;
  END IF;
  PERFORM job_deps_settle(ARRAY[OLD.id], how, NULL);
  RETURN NULL;
END
$$;

CREATE TRIGGER jobs_parent_ended_delete AFTER DELETE ON jobs
  FOR EACH ROW WHEN (OLD.dependents) EXECUTE FUNCTION jobs_parent_ended();
-- OF finished_at, not OF status: every statement that dead-letters a job sets finished_at
-- (the completion flush, the reaper, the release of lost claims), and the claim does not. A
-- statement whose SET list misses the trigger's column never evaluates its WHEN; one that
-- does builds the WHEN's expression once per statement (benchmarks/results/WORKFLOWS.md).
-- IS TRUE: false, not NULL, for a row without children, so that the rest is not evaluated.
CREATE TRIGGER jobs_parent_ended_failed AFTER UPDATE OF finished_at ON jobs
  FOR EACH ROW WHEN (OLD.dependents IS TRUE AND NEW.status::text = 'failed'
                     AND OLD.status::text <> 'failed')
  EXECUTE FUNCTION jobs_parent_ended();

-- An edge to a parent named by id, when the producer's transaction commits (deferred): a
-- parent still to end is marked, its row locked until this commit completes, so that its end,
-- written after, applies the edge (jobs_parent_ended); one that ended before is applied now,
-- from what a statement of its own sees. Nothing is locked while the producer's transaction
-- is open: a worker's flush and heartbeat never wait for it.
CREATE FUNCTION job_deps_named() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  how text;
BEGIN
  LOOP
    UPDATE jobs j SET dependents = true
    WHERE j.id = NEW.parent_id AND j.status::text IN ('waiting', 'queued', 'running');
    IF FOUND THEN
      RETURN NULL;
    END IF;
    SELECT j.status::text INTO how FROM jobs j WHERE j.id = NEW.parent_id;
    IF how IS NULL THEN
      SELECT h.status::text INTO how FROM jobs_history h WHERE h.id = NEW.parent_id;
    END IF;
    -- Live again (a dead-lettered parent retried meanwhile): mark it after all.
    EXIT WHEN how IS NULL OR how NOT IN ('waiting', 'queued', 'running');
  END LOOP;
  PERFORM job_deps_settle(ARRAY[NEW.parent_id], how, NEW.child_id);
  RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER job_deps_named AFTER INSERT ON job_deps
  DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW WHEN (NEW.named) EXECUTE FUNCTION job_deps_named();

-- A workflow's jobs and edges, in one call (Workflow.enqueue, src/asyncjobq/workflow.py).
-- `job_rows`: [[task, payload, queue, priority, run_at, delay, max_attempts, trace context,
-- key], ...]; `edge_rows`: [[parent's index in `job_rows` or null, parent's id or null,
-- child's index, run on failure], ...], a parent in the workflow coming before its child.
-- A job's count of parents and its mark as a parent are taken from the edges, not from the
-- caller. Returns the jobs' ids in order, or, when parents named by id do not exist, those ids
-- (unknown = true) and writes nothing.
CREATE FUNCTION enqueue_workflow(job_rows jsonb, edge_rows jsonb)
RETURNS TABLE (id bigint, unknown boolean) LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  ids bigint[];
  n int := jsonb_array_length(job_rows);
BEGIN
  IF EXISTS (SELECT FROM jsonb_array_elements(edge_rows) AS e
             WHERE NOT ((e->>2)::int BETWEEN 0 AND n - 1)
                OR (e->>0 IS NULL) = (e->>1 IS NULL)
                OR (e->>0)::int NOT BETWEEN 0 AND (e->>2)::int - 1) THEN
    RAISE EXCEPTION 'enqueue_workflow: an edge names no job of the workflow, or a parent '
      'that does not come before its child' USING ERRCODE = 'invalid_parameter_value';
  END IF;
  RETURN QUERY
    SELECT DISTINCT (e->>1)::bigint, true FROM jsonb_array_elements(edge_rows) AS e
    WHERE e->>1 IS NOT NULL
      AND NOT EXISTS (SELECT FROM jobs j WHERE j.id = (e->>1)::bigint)
      AND NOT EXISTS (SELECT FROM jobs_history h WHERE h.id = (e->>1)::bigint);
  IF FOUND THEN
    RETURN;
  END IF;
  -- Identity values come in insertion order: ordered by id, the ids are the rows' order.
  WITH e AS (SELECT (x->>0)::int AS parent, (x->>2)::int AS child
             FROM jsonb_array_elements(edge_rows) AS x),
  ins AS (
    INSERT INTO jobs AS j (task, payload, queue, priority, run_at, max_attempts,
                           trace_context, key, status, pending, dependents)
    SELECT r->>0, r->1, r->>2, (r->>3)::int,
      coalesce((r->>4)::timestamptz, now()) + make_interval(secs => (r->>5)::float8),
      (r->>6)::int, r->7, r->>8,
      CASE WHEN p.n IS NULL THEN 'queued' ELSE 'waiting' END::job_status, p.n,
      CASE WHEN k.parent IS NOT NULL THEN true END
    FROM jsonb_array_elements(job_rows) WITH ORDINALITY AS t(r, i)
    LEFT JOIN (SELECT child, count(*)::int AS n FROM e GROUP BY child) p ON p.child = t.i - 1
    LEFT JOIN (SELECT DISTINCT parent FROM e WHERE parent IS NOT NULL) k
      ON k.parent = t.i - 1
    ORDER BY t.i
    RETURNING j.id)
  SELECT array_agg(ins.id ORDER BY ins.id) INTO ids FROM ins;
  -- Edges to parents named by id in their ids' order: the checks at commit (deferred, in the
  -- order of the rows) then lock those parents in the order the worker's statements do.
  INSERT INTO job_deps (parent_id, child_id, run_on_failure, named)
  SELECT coalesce((e->>1)::bigint, ids[(e->>0)::int + 1]), ids[(e->>2)::int + 1],
         (e->>3)::boolean, e->>1 IS NOT NULL
  FROM jsonb_array_elements(edge_rows) AS e
  ORDER BY (e->>1)::bigint NULLS FIRST;
  RETURN QUERY SELECT u.id, false FROM unnest(ids) AS u(id);
END
$$;

-- Producers are granted these by name (docs/guides/roles.md), not every role by default.
REVOKE EXECUTE ON FUNCTION enqueue_workflow(jsonb, jsonb) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION job_deps_settle(bigint[], text, bigint) FROM PUBLIC;
