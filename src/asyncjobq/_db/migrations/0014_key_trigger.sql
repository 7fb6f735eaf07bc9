-- asyncjobq schema, version 14: a job's dedup_key follows its status changes through one AFTER
-- UPDATE trigger instead of a BEFORE and an AFTER one (0013_generations.sql), and one function,
-- jobs_key_follow(), keeps job_keys for every trigger of the key (it replaces jobs_key_take and
-- jobs_key_free, whose take and free the UPDATE trigger would otherwise have written again).
--
-- Every claim updates the rows it takes (queued -> running), so every claim fired both UPDATE
-- triggers: each statement parsed and compiled their WHEN clauses, and the BEFORE one fetched
-- and locked every row again before it was updated (PostgreSQL does so for any BEFORE UPDATE row
-- trigger, whatever its WHEN). As one AFTER trigger the worker's flush costs the server about
-- 1.4 us a job less at batch 10 (benchmarks/statement_cost.py, variant split-update-triggers).
-- What the triggers do is the same: an insert whose key a live job holds inserts nothing; a
-- failed job requeued takes its key again, or the statement fails with unique_violation (an
-- AFTER trigger's error ends the statement as the BEFORE one's did); a job that stops being
-- queued or running frees it. Rows that rotate_jobs moves are left alone (`asyncjobq.moving`).
-- One difference, for a statement of yours only (none of ours does it): one UPDATE that ends a
-- live job and requeues a failed one of the same key now passes the key when the end's row is
-- updated first; the BEFORE trigger took it before any end of the statement freed it, and the
-- statement always failed.
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

-- Whether to free or take is the triggers' WHEN (below); OLD is NULL in an insert, NEW in a
-- delete. A BEFORE trigger (the insert's) gets NEW back, or NULL to insert nothing.
CREATE FUNCTION jobs_key_follow() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
  IF current_setting('asyncjobq.moving', true) IS DISTINCT FROM 'on' THEN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND OLD.status::text IN ('queued', 'running')
                            AND NEW.status::text NOT IN ('queued', 'running')) THEN
      DELETE FROM job_keys WHERE dedup_key = OLD.dedup_key AND job_id = OLD.id;
    ELSE
      INSERT INTO job_keys (dedup_key, job_id) VALUES (NEW.dedup_key, NEW.id)
        ON CONFLICT (dedup_key) DO UPDATE SET job_id = job_keys.job_id
        WHERE job_keys.job_id = NEW.id;
      IF NOT FOUND THEN  -- held by another live job
        IF TG_OP = 'INSERT' THEN
          RETURN NULL;  -- as ON CONFLICT DO NOTHING: enqueue returns the live job's id
        END IF;
        RAISE unique_violation USING
          MESSAGE = format('dedup_key %L is held by another live job', NEW.dedup_key),
          CONSTRAINT = 'job_keys_pkey';
      END IF;
    END IF;
  END IF;
  IF TG_WHEN = 'BEFORE' THEN
    RETURN NEW;
  END IF;
  RETURN NULL;
END
$$;

DROP TRIGGER jobs_key_insert ON jobs;
DROP TRIGGER jobs_key_requeue ON jobs;
DROP TRIGGER jobs_key_end ON jobs;
DROP TRIGGER jobs_key_delete ON jobs;
DROP FUNCTION jobs_key_take();
DROP FUNCTION jobs_key_free();

CREATE TRIGGER jobs_key_insert BEFORE INSERT ON jobs
  FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL AND NEW.status::text IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_follow();
-- OF status, finished_at as before: every statement of ours that ends or requeues a job sets
-- finished_at, and one of yours that sets the status by hand is seen too.
CREATE TRIGGER jobs_key_update AFTER UPDATE OF status, finished_at ON jobs
  FOR EACH ROW WHEN ((OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running')
                      AND NEW.status::text NOT IN ('queued', 'running'))
                     OR (NEW.dedup_key IS NOT NULL
                         AND OLD.status::text NOT IN ('queued', 'running')
                         AND NEW.status::text IN ('queued', 'running')))
  EXECUTE FUNCTION jobs_key_follow();
CREATE TRIGGER jobs_key_delete AFTER DELETE ON jobs
  FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_follow();
