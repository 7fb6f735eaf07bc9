-- asyncjobq schema, version 15: the dedup_key's row triggers test less in their WHEN; their
-- function decides the rest (0014_key_trigger.sql tested each status in WHEN).
--
-- PostgreSQL keeps a trigger's WHEN as the text of its expression tree and reads it back, and
-- plans it, in every statement that fires the trigger on a row: every claim (an UPDATE of
-- status) and every flush (a DELETE) paid for the key triggers' conditions, and every enqueue
-- for the insert's. The insert's and the delete's now test only that a key is there (a
-- delete of a keyed job that was not live, an insert of one that is not, call the function
-- for nothing); the update's, with two comparisons on the enum, still leaves a claim
-- (queued -> running) out: a key moves only when a row stops being live (its new status is
-- not running: it may be queued again, the function sees) or becomes live (its old status
-- sorts after running: done, failed, cancelled, waiting, as every status but queued and
-- running does; job_status gains values only at its end). The worker's flush costs the
-- server about 3 µs a job less at batch 10 (benchmarks/statement_cost.py, variant
-- status-when: version 14's conditions) and a one-row enqueue about 7 µs less.
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

-- OLD is NULL in an insert, NEW in a delete: a row is live while queued or running.
CREATE OR REPLACE FUNCTION jobs_key_follow() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  was_live boolean := TG_OP <> 'INSERT' AND OLD.status::text IN ('queued', 'running');
  is_live boolean := TG_OP <> 'DELETE' AND NEW.status::text IN ('queued', 'running');
BEGIN
  IF current_setting('asyncjobq.moving', true) IS DISTINCT FROM 'on' THEN
    IF OLD.dedup_key IS NOT NULL AND was_live AND NOT is_live THEN
      DELETE FROM job_keys WHERE dedup_key = OLD.dedup_key AND job_id = OLD.id;
    ELSIF NEW.dedup_key IS NOT NULL AND is_live AND NOT was_live THEN
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
DROP TRIGGER jobs_key_update ON jobs;
DROP TRIGGER jobs_key_delete ON jobs;
CREATE TRIGGER jobs_key_insert BEFORE INSERT ON jobs
  FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL) EXECUTE FUNCTION jobs_key_follow();
-- OF status, finished_at as before: every statement of ours that ends or requeues a job sets
-- finished_at, and one of yours that sets the status by hand is seen too.
CREATE TRIGGER jobs_key_update AFTER UPDATE OF status, finished_at ON jobs
  FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL AND NEW.status <> 'running'
                     OR NEW.dedup_key IS NOT NULL AND OLD.status > 'running')
  EXECUTE FUNCTION jobs_key_follow();
CREATE TRIGGER jobs_key_delete AFTER DELETE ON jobs
  FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL) EXECUTE FUNCTION jobs_key_follow();
