-- asyncjobq schema, version 16: a child moved between generations while its parent ends is
-- still released, or cancelled.
--
-- job_deps_settle() (0012_workflows.sql) runs in the statement that ends a parent. The
-- leader's rotation moves a waiting child from one partition to the other by a DELETE and an
-- INSERT (jobs_move(), 0013_generations.sql). A settle statement that waited for the child's
-- row while the move held it found that version deleted, and the moved one is newer than its
-- snapshot: the edge was marked applied, the child kept its count, and it waited for ever
-- (`doctor` names it stranded). What a statement does not find is now looked for once more,
-- by a statement of its own, which sees the move: the count taken off, or the child
-- cancelled. No lock on `jobs`: the function is replaced, and the next call runs the new one.
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

-- As 0012_workflows.sql says, and: `missed`, the children whose count this round did not
-- find waiting (moved, or ended meanwhile: cancelled, run by hand), are counted down again
-- in a statement of their own; a doomed child the cancel did not find is looked for once
-- more. Those are locked after the children the first statement found: two parents ending at
-- once that share a moved child and another can deadlock, and PostgreSQL ends one of them (a
-- worker's flush is sent again). The INSERT into jobs_history lists HISTORY_COLUMNS
-- (src/asyncjobq/_db/sql/common.py).
CREATE OR REPLACE FUNCTION job_deps_settle(frontier bigint[], how text, only_child bigint)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  ok boolean := how IS NOT DISTINCT FROM 'done';
  why text := CASE how WHEN 'failed' THEN 'dead-lettered' WHEN 'cancelled' THEN 'cancelled'
                       ELSE 'deleted' END;
  sent int;
  doomed bigint[];
  blamed bigint[];
  missed bigint[];
  missed_n int[];
  gone_ids bigint[];
  cancelled bigint[];
BEGIN
  LOOP
    WITH e AS (
      UPDATE job_deps d SET ended = true
      WHERE d.parent_id = ANY(frontier) AND d.ended IS NULL
        AND (only_child IS NULL OR d.child_id = only_child)
      RETURNING d.parent_id, d.child_id, d.run_on_failure),
    g AS (
      SELECT child_id, count(*)::int AS n FROM e WHERE ok OR run_on_failure
      GROUP BY child_id),
    go AS (
      UPDATE jobs c SET pending = c.pending - g.n,
        status = CASE WHEN c.pending > g.n THEN 'waiting' ELSE 'queued' END::job_status,
        run_at = CASE WHEN c.pending > g.n THEN c.run_at ELSE greatest(c.run_at, now()) END
      FROM g
      WHERE c.id = g.child_id AND c.status::text = 'waiting'
      RETURNING c.id, c.queue, c.priority, c.run_at, c.status::text AS status),
    hit AS (
      SELECT child_id, min(parent_id) AS parent_id FROM e WHERE NOT (ok OR run_on_failure)
      GROUP BY child_id ORDER BY child_id)
    -- Workers hear of the children made queued, with their lanes (0009_notify_lanes.sql).
    SELECT (SELECT notify_lanes(current_schema() || '_jobs', array_agg(queue),
                                array_agg(priority), array_agg(run_at)) FROM go WHERE status = 'queued'),
           ARRAY(SELECT child_id FROM hit), ARRAY(SELECT parent_id FROM hit), m.ids, m.ns
      -- The children of `g` that `go` did not return, by one grouping (a join of the two
      -- CTE scans could be a nested loop, quadratic in a parent of 10,000 children).
      FROM (SELECT array_agg(x.child_id ORDER BY x.child_id), array_agg(x.n ORDER BY x.child_id)
            FROM (SELECT u.child_id, max(u.n) AS n
                  FROM (SELECT child_id, n, 1 AS k FROM g
                        UNION ALL SELECT id, 0, -1 FROM go) u
                  GROUP BY u.child_id HAVING sum(u.k) = 1) x) AS m(ids, ns)
      INTO sent, doomed, blamed, missed, missed_n;
    IF missed IS NOT NULL THEN
      WITH go AS (
        UPDATE jobs c SET pending = c.pending - m.n,
          status = CASE WHEN c.pending > m.n THEN 'waiting' ELSE 'queued' END::job_status,
          run_at = CASE WHEN c.pending > m.n THEN c.run_at ELSE greatest(c.run_at, now()) END
        FROM unnest(missed, missed_n) AS m(child_id, n)
        WHERE c.id = m.child_id AND c.status::text = 'waiting'
        RETURNING c.queue, c.priority, c.run_at, c.status::text AS status)
      SELECT notify_lanes(current_schema() || '_jobs', array_agg(queue), array_agg(priority),
                          array_agg(run_at))
        FROM go WHERE status = 'queued' INTO sent;
    END IF;
    EXIT WHEN cardinality(doomed) = 0;
    cancelled := '{}';
    FOR pass IN 1..2 LOOP
      -- The cancelled children's marks are taken off first: their DELETE must not fire the
      -- trigger again (their children are this loop's next round). A child that has children
      -- and is being moved is missed by this UPDATE but found by the DELETE, whose snapshot
      -- is newer: its trigger then settles its children, as this loop would have.
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
        INTO sent, gone_ids;
      cancelled := cancelled || gone_ids;
      EXIT WHEN cardinality(gone_ids) = cardinality(doomed);  -- every one found
      SELECT array_agg(x.child ORDER BY x.child), array_agg(x.parent ORDER BY x.child)
        FROM unnest(doomed, blamed) AS x(child, parent) WHERE x.child <> ALL(gone_ids)
        INTO doomed, blamed;
      EXIT WHEN doomed IS NULL;
    END LOOP;
    frontier := cancelled;
    EXIT WHEN cardinality(frontier) = 0;
    ok := false;
    why := 'cancelled';
    only_child := NULL;
  END LOOP;
END
$$;
