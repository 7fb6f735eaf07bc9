-- asyncjobq schema, version 3: history counted as it is written.
-- stats() counted every row of jobs_history on each call: 1.3 s with 10,000,000 rows, and the
-- CLI's `status` with it. Statement-level triggers now keep per (queue, status) counts of
-- history in history_counts, so stats() reads a few rows whatever the history's size.

-- The backfill must count exactly the rows no trigger will count: those committed before this
-- transaction took the lock. Writers of history (completions, cancel, the pruner) wait from
-- here to the commit (about a second per 10,000,000 rows; readers go on), and the statement
-- they were waiting for then sees the triggers below. No writer can be halfway through: the
-- lock waits for every transaction that has written to the table.
LOCK TABLE jobs_history IN SHARE ROW EXCLUSIVE MODE;

-- Sharded rows, so that the completers of many workers, each adding to the same (queue, 'done')
-- in every statement, do not queue up on one row lock until each other's commits: a writer
-- adds to the shard of its backend (1 + pid % 64); shard 0 holds what the backfill counted
-- and what the leader folds into it (pruner.py). stats() sums the shards. A shard may go
-- negative (a row counted in one shard, deleted by a backend of another); the sums are exact.
CREATE TABLE history_counts (
  queue  text       NOT NULL,
  status job_status NOT NULL,
  shard  smallint   NOT NULL,
  n      bigint     NOT NULL,
  PRIMARY KEY (queue, status, shard)
) WITH (
  -- Updated in place by every completion statement: room on each page keeps the updates HOT.
  fillfactor = 50
);

INSERT INTO history_counts (queue, status, shard, n)
SELECT queue, status, 0, count(*) FROM jobs_history GROUP BY queue, status;

-- One call per statement, whatever its number of rows; the rows come aggregated per (queue,
-- status) and in key order, so two writers lock their rows in the same order (no deadlock,
-- the leader's fold takes them in that order too).
CREATE FUNCTION history_counts_apply() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO history_counts AS c (queue, status, shard, n)
    SELECT r.queue, r.status, 1 + pg_backend_pid() % 64, count(*) FROM new_rows r
    GROUP BY r.queue, r.status ORDER BY r.queue, r.status
    ON CONFLICT (queue, status, shard) DO UPDATE SET n = c.n + excluded.n;
  ELSIF TG_OP = 'DELETE' THEN
    INSERT INTO history_counts AS c (queue, status, shard, n)
    SELECT r.queue, r.status, 1 + pg_backend_pid() % 64, -count(*) FROM old_rows r
    GROUP BY r.queue, r.status ORDER BY r.queue, r.status
    ON CONFLICT (queue, status, shard) DO UPDATE SET n = c.n + excluded.n;
  ELSIF TG_OP = 'UPDATE' THEN
    -- asyncjobq never updates history; an operator's UPDATE of queue or status stays counted.
    INSERT INTO history_counts AS c (queue, status, shard, n)
    SELECT d.queue, d.status, 1 + pg_backend_pid() % 64, sum(d.n) FROM (
      SELECT r.queue, r.status, 1 AS n FROM new_rows r
      UNION ALL SELECT r.queue, r.status, -1 FROM old_rows r) d
    GROUP BY d.queue, d.status HAVING sum(d.n) <> 0 ORDER BY d.queue, d.status
    ON CONFLICT (queue, status, shard) DO UPDATE SET n = c.n + excluded.n;
  ELSE
    -- TRUNCATE: a DELETE here would miss a shard-0 row the leader's fold inserted and had
    -- not committed yet (the DELETE's snapshot predates it); TRUNCATE waits for the fold.
    TRUNCATE history_counts;
  END IF;
  RETURN NULL;
END
$$;

CREATE TRIGGER history_counts_insert AFTER INSERT ON jobs_history
  REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION history_counts_apply();
CREATE TRIGGER history_counts_delete AFTER DELETE ON jobs_history
  REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION history_counts_apply();
CREATE TRIGGER history_counts_update AFTER UPDATE ON jobs_history
  REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION history_counts_apply();
CREATE TRIGGER history_counts_truncate AFTER TRUNCATE ON jobs_history
  FOR EACH STATEMENT EXECUTE FUNCTION history_counts_apply();

-- This index existed for stats()'s count (an index-only scan of all history) and nothing else
-- reads by it; every completed job paid an insert into it. Without it the health check's plan
-- cannot pick it either (it had: a bitmap AND over every done row of each queue, 0.3 s at
-- 10,000,000 rows, where the recent rows alone are a few pages).
DROP INDEX jobs_history_queue_status_idx;

-- The health check's "finished in the last minute" reads the BRIN ranges that hold recent
-- rows, but a range no vacuum has summarized yet matches every query, and autovacuum comes
-- after 5 % of the table has been inserted (500,000 rows at 10,000,000). Summarize each range
-- when it fills instead (an autovacuum work item, done at its next round).
ALTER INDEX jobs_history_finished_brin SET (autosummarize = on);
