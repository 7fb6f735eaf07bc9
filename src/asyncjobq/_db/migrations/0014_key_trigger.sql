-- asyncjobq schema, version 14: a job's dedup_key follows its status changes through one AFTER
-- UPDATE trigger instead of a BEFORE and an AFTER one (0013_generations.sql).
--
-- Every claim updates the rows it takes (queued -> running), so every claim fired both: each
-- statement parsed and compiled their WHEN clauses, and the BEFORE one fetched and locked every
-- row again before it was updated (PostgreSQL does so for any BEFORE UPDATE row trigger, whatever
-- its WHEN). As one AFTER trigger the worker's flush costs the server about 1.4 us a job less at
-- batch 10 (benchmarks/statement_cost.py, variant split-update-triggers). What it does is the
-- same: a failed job requeued takes its key again, or the statement fails with unique_violation
-- (an AFTER trigger's error ends the statement as the BEFORE one's did); a job that stops being
-- queued or running frees it. Rows that rotate_jobs moves are left alone (`asyncjobq.moving`).
-- One difference, for a statement of yours only (none of ours does it): one UPDATE that ends a
-- live job and requeues a failed one of the same key now passes the key when the end's row is
-- updated first; the BEFORE trigger took it before any end of the statement freed it, and the
-- statement always failed.
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

CREATE FUNCTION jobs_key_update() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
  IF current_setting('asyncjobq.moving', true) = 'on' THEN
    RETURN NULL;
  END IF;
  IF OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running')
     AND NEW.status::text NOT IN ('queued', 'running') THEN
    DELETE FROM job_keys WHERE dedup_key = OLD.dedup_key AND job_id = OLD.id;
  END IF;
  IF NEW.dedup_key IS NOT NULL AND OLD.status::text NOT IN ('queued', 'running')
     AND NEW.status::text IN ('queued', 'running') THEN
    INSERT INTO job_keys (dedup_key, job_id) VALUES (NEW.dedup_key, NEW.id)
      ON CONFLICT (dedup_key) DO UPDATE SET job_id = job_keys.job_id
      WHERE job_keys.job_id = NEW.id;
    IF NOT FOUND THEN
      RAISE unique_violation USING
        MESSAGE = format('dedup_key %L is held by another live job', NEW.dedup_key),
        CONSTRAINT = 'job_keys_pkey';
    END IF;
  END IF;
  RETURN NULL;
END
$$;

DROP TRIGGER jobs_key_requeue ON jobs;
DROP TRIGGER jobs_key_end ON jobs;
-- OF status, finished_at as before: every statement of ours that ends or requeues a job sets
-- finished_at, and one of yours that sets the status by hand is seen too.
CREATE TRIGGER jobs_key_update AFTER UPDATE OF status, finished_at ON jobs
  FOR EACH ROW WHEN ((OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running')
                      AND NEW.status::text NOT IN ('queued', 'running'))
                     OR (NEW.dedup_key IS NOT NULL
                         AND OLD.status::text NOT IN ('queued', 'running')
                         AND NEW.status::text IN ('queued', 'running')))
  EXECUTE FUNCTION jobs_key_update();
