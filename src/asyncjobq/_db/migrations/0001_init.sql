-- asyncjobq schema, version 1.
-- Applied by `asyncjobq install` with search_path set to the target schema only, so every
-- name below lands in that schema. Runtime statements (src/asyncjobq/_db/sql/) qualify names.

CREATE TYPE job_status AS ENUM ('queued', 'running', 'done', 'failed', 'cancelled');

-- The hot table: only queued, running and failed (dead-letter) rows live here. Finished
-- (done, cancelled) rows are moved to jobs_history by the completion statement, so the claim
-- index does not fill with entries for rows that will never be claimed again (the article's
-- 461 index blocks instead of 4).
CREATE TABLE jobs (
  id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  queue        text        NOT NULL DEFAULT 'default',
  task         text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       job_status  NOT NULL DEFAULT 'queued',
  priority     int         NOT NULL DEFAULT 0,
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int         NOT NULL DEFAULT 0,
  max_attempts int         NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
  dedup_key    text,
  locked_by    text,
  locked_at    timestamptz,
  last_error   text,
  created_at   timestamptz NOT NULL DEFAULT now(),
  finished_at  timestamptz
) WITH (
  -- A queue table turns over its whole content constantly: vacuum after 1 % of it is dead
  -- (the default 20 % lets the claim index bloat for minutes), and do not throttle it.
  autovacuum_vacuum_scale_factor = 0.01,
  autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_insert_scale_factor = 0.01,
  autovacuum_analyze_scale_factor = 0.02,
  autovacuum_vacuum_cost_delay = 0
);

-- The claim query's WHERE and ORDER BY, exactly as the article has it.
CREATE INDEX jobs_dequeue_idx ON jobs (queue, priority DESC, run_at, id) WHERE status = 'queued';
-- Stale running rows, for the reaper.
CREATE INDEX jobs_running_idx ON jobs (locked_at) WHERE status = 'running';
-- At most one queued-or-running job per dedup key.
CREATE UNIQUE INDEX jobs_dedup_idx ON jobs (dedup_key)
  WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');

-- Append-only record of finished jobs; `get` and `stats` read it, nothing claims from it.
CREATE TABLE jobs_history (
  id           bigint      PRIMARY KEY,
  queue        text        NOT NULL,
  task         text        NOT NULL,
  payload      jsonb       NOT NULL,
  status       job_status  NOT NULL,
  priority     int         NOT NULL,
  run_at       timestamptz NOT NULL,
  attempts     int         NOT NULL,
  max_attempts int         NOT NULL,
  dedup_key    text,
  locked_by    text,
  last_error   text,
  created_at   timestamptz NOT NULL,
  finished_at  timestamptz NOT NULL
) WITH (
  autovacuum_vacuum_insert_scale_factor = 0.05,
  autovacuum_analyze_scale_factor = 0.05
);
CREATE INDEX jobs_history_queue_status_idx ON jobs_history (queue, status);
CREATE INDEX jobs_history_finished_brin ON jobs_history USING brin (finished_at);

-- Wake workers from any producer, SQL included: one notification per queue per statement
-- (not per row), carrying the earliest run_at so a worker can sleep until exactly then.
-- The channel is "<schema>_jobs"; the schema name is validated to keep it under 63 bytes.
CREATE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify(
    TG_TABLE_SCHEMA || '_jobs',
    json_build_object('queue', n.queue, 'run_at', extract(epoch FROM min(n.run_at)))::text)
  FROM new_jobs n
  GROUP BY n.queue;
  RETURN NULL;
END
$$;

CREATE TRIGGER jobs_notify AFTER INSERT ON jobs
  REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify();

-- The same enqueue from SQL for any language: SELECT <schema>.enqueue('send_email', '{}');
-- A live duplicate dedup_key returns the existing job's id, as Queue.enqueue does.
CREATE FUNCTION enqueue(
  task text, payload jsonb DEFAULT '{}', queue text DEFAULT 'default', priority int DEFAULT 0,
  run_at timestamptz DEFAULT now(), max_attempts int DEFAULT 3, dedup_key text DEFAULT NULL
) RETURNS bigint LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
#variable_conflict use_column
DECLARE
  new_id bigint;
BEGIN
  LOOP
    INSERT INTO jobs (task, payload, queue, priority, run_at, max_attempts, dedup_key)
    VALUES (enqueue.task, enqueue.payload, enqueue.queue, enqueue.priority, enqueue.run_at,
            enqueue.max_attempts, enqueue.dedup_key)
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running')
    DO NOTHING
    RETURNING id INTO new_id;
    IF new_id IS NOT NULL THEN
      RETURN new_id;
    END IF;
    SELECT j.id INTO new_id FROM jobs j
     WHERE j.dedup_key = enqueue.dedup_key AND j.status IN ('queued', 'running');
    IF new_id IS NOT NULL THEN
      RETURN new_id;
    END IF;
  END LOOP;
END
$$;
