-- asyncjobq schema, version 13: jobs partitioned by generation (docs/how-it-works/storage.md).
--
-- Under a pinned xmin horizon no vacuum removes the dead versions every job leaves in the hot
-- table; only TRUNCATE gives their space back, and it needs a table with no live row left.
-- `jobs` becomes a table partitioned on `gen`, two partitions, jobs_0 and jobs_1; one of them
-- is current (`generation`): every insert goes to it, workers claim from it by its name. When
-- the current one has grown while the horizon is held, the leader (rotate_jobs below) moves
-- the other one's live rows out, TRUNCATEs it and makes it current, and moves the queued rows
-- of the old one in: a claim reads one partition and keeps the queue's order.
--
-- The upgrade: the table becomes generation 0 without a rewrite (a column with a constant
-- default, a CHECK scanned once, its indexes attached to the partitioned ones as they are);
-- the identity becomes a sequence of its own (job_ids) that carries on from the same value.
-- The whole migration holds ACCESS EXCLUSIVE on jobs (docs/operations/upgrading.md says how
-- long on 1,000,000 jobs).
--
-- One thing a partitioned table cannot keep: a unique index that leaves out the partition key.
-- "At most one queued-or-running job per dedup_key" (the unique index jobs_dedup_idx) moves to
-- job_keys, kept by triggers on jobs: the insert of a job whose key is held inserts nothing,
-- as `ON CONFLICT DO NOTHING` did; requeueing a failed job whose key is held raises
-- unique_violation, as the index did.

-- First: no insert may draw an id from the identity between the read of its last value
-- and its removal below.
LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE;

CREATE TABLE generation (
  one         boolean     PRIMARY KEY DEFAULT true CHECK (one),
  gen         smallint    NOT NULL CHECK (gen IN (0, 1)),
  switched_at timestamptz NOT NULL DEFAULT now(),
  switches    bigint      NOT NULL DEFAULT 0
);
INSERT INTO generation (gen) VALUES (0);
-- Read by every insert (the default of jobs.gen): nothing in it is private.
GRANT SELECT ON generation TO PUBLIC;

-- STABLE, without a SET clause: evaluated once per row of an insert, a SET clause would cost
-- each row a configuration change. The table is named with its schema, written in here.
DO $$
BEGIN
  EXECUTE format('CREATE FUNCTION current_gen() RETURNS smallint LANGUAGE sql STABLE'
                 ' AS $f$ SELECT gen FROM %I.generation $f$', current_schema());
END
$$;
-- Every insert calls it: granted even where functions' EXECUTE was revoked from PUBLIC.
GRANT EXECUTE ON FUNCTION current_gen() TO PUBLIC;

-- The identity's sequence goes with the identity: ids carry on from job_ids.
CREATE SEQUENCE job_ids AS bigint;
DO $$
DECLARE
  last bigint;
  called boolean;
BEGIN
  EXECUTE format('SELECT last_value, is_called FROM %s', pg_get_serial_sequence('jobs', 'id'))
    INTO last, called;
  PERFORM setval('job_ids', last, called);
END
$$;
ALTER TABLE jobs ALTER COLUMN id DROP IDENTITY;
GRANT USAGE ON SEQUENCE job_ids TO PUBLIC;

-- The table becomes generation 0, its indexes and triggers renamed or dropped: the
-- partitioned table takes their names.
ALTER TABLE jobs RENAME TO jobs_0;
ALTER TABLE jobs_0 RENAME CONSTRAINT jobs_pkey TO jobs_0_pkey;
ALTER INDEX jobs_dequeue_idx RENAME TO jobs_0_dequeue_idx;
ALTER INDEX jobs_running_idx RENAME TO jobs_0_running_idx;
ALTER INDEX jobs_failed_id_idx RENAME TO jobs_0_failed_id_idx;
ALTER INDEX jobs_failed_browse_idx RENAME TO jobs_0_failed_browse_idx;
ALTER INDEX jobs_flow_running_idx RENAME TO jobs_0_flow_running_idx;
ALTER INDEX jobs_key_queued_idx RENAME TO jobs_0_key_queued_idx;
ALTER INDEX jobs_key_retrying_idx RENAME TO jobs_0_key_retrying_idx;
-- Already there under these names (renamed above): written out for doctor, which knows the
-- indexes the migrations leave by their CREATE INDEX (_db/migrations/__init__.py).
CREATE INDEX IF NOT EXISTS jobs_0_dequeue_idx ON jobs_0 (queue, priority DESC, run_at, id)
  WHERE status = 'queued';
CREATE INDEX IF NOT EXISTS jobs_0_running_idx ON jobs_0 (locked_at) WHERE status = 'running';
CREATE INDEX IF NOT EXISTS jobs_0_failed_id_idx ON jobs_0 (id) WHERE status = 'failed';
CREATE INDEX IF NOT EXISTS jobs_0_failed_browse_idx ON jobs_0 (finished_at)
  WHERE status = 'failed';
CREATE INDEX IF NOT EXISTS jobs_0_flow_running_idx ON jobs_0 (task, key)
  WHERE status = 'running' AND flow;
CREATE INDEX IF NOT EXISTS jobs_0_key_queued_idx ON jobs_0 (task, key, priority DESC, run_at, id)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts = 0;
CREATE INDEX IF NOT EXISTS jobs_0_key_retrying_idx ON jobs_0 (task, key)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts > 0;
DROP TRIGGER jobs_notify ON jobs_0;
DROP TRIGGER jobs_parent_ended_delete ON jobs_0;
DROP TRIGGER jobs_parent_ended_failed ON jobs_0;

-- The keys of live jobs, before the index that guarded them goes.
CREATE TABLE job_keys (
  dedup_key text   PRIMARY KEY,
  job_id    bigint NOT NULL
);
INSERT INTO job_keys (dedup_key, job_id)
  SELECT dedup_key, id FROM jobs_0
  WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');
DROP INDEX jobs_dedup_idx;
CREATE INDEX jobs_0_dedup_idx ON jobs_0 (dedup_key)
  WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');

ALTER TABLE jobs_0 ADD COLUMN gen smallint NOT NULL DEFAULT 0;
CREATE TABLE jobs (LIKE jobs_0 INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
  PARTITION BY LIST (gen);
ALTER TABLE jobs ALTER COLUMN id SET DEFAULT nextval('job_ids');
ALTER TABLE jobs ALTER COLUMN gen SET DEFAULT current_gen();
ALTER TABLE jobs_0 ALTER COLUMN id SET DEFAULT nextval('job_ids');
-- ATTACH finds this constraint and does not scan the table again to prove it.
ALTER TABLE jobs_0 ADD CONSTRAINT jobs_0_gen CHECK (gen = 0);
ALTER TABLE jobs ATTACH PARTITION jobs_0 FOR VALUES IN (0);
ALTER TABLE jobs_0 DROP CONSTRAINT jobs_0_gen;
CREATE TABLE jobs_1 PARTITION OF jobs FOR VALUES IN (1) WITH (
  autovacuum_vacuum_scale_factor = 0.01,
  autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_insert_scale_factor = 0.01,
  autovacuum_analyze_scale_factor = 0.02,
  autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE jobs_1 ADD CONSTRAINT jobs_1_pkey PRIMARY KEY (id);
-- jobs_1's indexes, named as jobs_0's are.
CREATE INDEX jobs_1_dequeue_idx ON jobs_1 (queue, priority DESC, run_at, id)
  WHERE status = 'queued';
CREATE INDEX jobs_1_running_idx ON jobs_1 (locked_at) WHERE status = 'running';
CREATE INDEX jobs_1_failed_id_idx ON jobs_1 (id) WHERE status = 'failed';
CREATE INDEX jobs_1_failed_browse_idx ON jobs_1 (finished_at) WHERE status = 'failed';
CREATE INDEX jobs_1_flow_running_idx ON jobs_1 (task, key) WHERE status = 'running' AND flow;
CREATE INDEX jobs_1_key_queued_idx ON jobs_1 (task, key, priority DESC, run_at, id)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts = 0;
CREATE INDEX jobs_1_key_retrying_idx ON jobs_1 (task, key)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts > 0;
CREATE INDEX jobs_1_dedup_idx ON jobs_1 (dedup_key)
  WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');

-- The indexes of the partitioned table: each finds its partitions' own and attaches them (no
-- build).
CREATE INDEX jobs_dequeue_idx ON jobs (queue, priority DESC, run_at, id) WHERE status = 'queued';
CREATE INDEX jobs_running_idx ON jobs (locked_at) WHERE status = 'running';
CREATE INDEX jobs_failed_id_idx ON jobs (id) WHERE status = 'failed';
CREATE INDEX jobs_failed_browse_idx ON jobs (finished_at) WHERE status = 'failed';
CREATE INDEX jobs_flow_running_idx ON jobs (task, key) WHERE status = 'running' AND flow;
CREATE INDEX jobs_key_queued_idx ON jobs (task, key, priority DESC, run_at, id)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts = 0;
CREATE INDEX jobs_key_retrying_idx ON jobs (task, key)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts > 0;
-- The live job of a key, for enqueue's re-read and the requeue of failed jobs: no longer
-- unique (job_keys is), the same lookups.
CREATE INDEX jobs_dedup_idx ON jobs (dedup_key)
  WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running');

-- Who could use the table can use the partitioned one and both partitions (workers name the
-- partitions; grants on a partitioned table do not reach them), column grants included.
DO $$
DECLARE
  g record;
BEGIN
  FOR g IN
    SELECT a.privilege_type AS p, NULL::name AS col,
           CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS who
      FROM pg_class c, aclexplode(c.relacl) a
     WHERE c.oid = 'jobs_0'::regclass AND a.grantee <> c.relowner
    UNION ALL
    SELECT a.privilege_type, t.attname,
           CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END
      FROM pg_attribute t, aclexplode(t.attacl) a
     WHERE t.attrelid = 'jobs_0'::regclass AND t.attacl IS NOT NULL AND NOT t.attisdropped
  LOOP
    IF g.col IS NULL THEN
      EXECUTE format('GRANT %s ON jobs, jobs_1 TO %s', g.p, g.who);
    ELSE
      EXECUTE format('GRANT %s (%I) ON jobs, jobs_1 TO %s', g.p, g.col, g.who);
    END IF;
  END LOOP;
END
$$;

CREATE TRIGGER jobs_notify AFTER INSERT ON jobs
  REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT EXECUTE FUNCTION jobs_notify();

-- Rows that rotate_jobs moves from one partition to the other are deleted and inserted
-- again: the triggers of a job's end, and of its key, leave them alone
-- (`asyncjobq.moving`, set for its transaction only).
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

CREATE OR REPLACE FUNCTION jobs_parent_ended() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  how text;
BEGIN
  IF current_setting('asyncjobq.moving', true) = 'on' THEN
    RETURN NULL;
  END IF;
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
CREATE TRIGGER jobs_parent_ended_failed AFTER UPDATE OF finished_at ON jobs
  FOR EACH ROW WHEN (OLD.dependents IS TRUE AND NEW.status::text = 'failed'
                     AND OLD.status::text <> 'failed')
  EXECUTE FUNCTION jobs_parent_ended();

-- A job with a dedup_key takes its key as it is inserted queued or running: when a live job
-- holds it, the row is not inserted (enqueue then returns that job's id). A failed job
-- requeued takes it again (Queue.retry, retry_failed), or the statement fails with
-- unique_violation. Owner's rights: producers need no grant on job_keys. ON CONFLICT waits
-- for the holder's transaction; no snapshot decides (a REPEATABLE READ caller's might miss a
-- holder moved by a switch).
CREATE FUNCTION jobs_key_take() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
  IF current_setting('asyncjobq.moving', true) = 'on' THEN
    RETURN NEW;
  END IF;
  INSERT INTO job_keys (dedup_key, job_id) VALUES (NEW.dedup_key, NEW.id)
    ON CONFLICT (dedup_key) DO UPDATE SET job_id = job_keys.job_id
    WHERE job_keys.job_id = NEW.id;
  IF FOUND THEN
    RETURN NEW;  -- taken, or held by this very job already
  END IF;
  IF TG_OP = 'INSERT' THEN
    RETURN NULL;  -- as ON CONFLICT DO NOTHING: enqueue returns the live job's id
  END IF;
  RAISE unique_violation USING
    MESSAGE = format('dedup_key %L is held by another live job', NEW.dedup_key),
    CONSTRAINT = 'job_keys_pkey';
END
$$;

-- Its key is free once the job is no longer queued or running: done or cancelled (deleted),
-- dead-lettered (finished_at set), deleted by hand.
CREATE FUNCTION jobs_key_free() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
  IF current_setting('asyncjobq.moving', true) = 'on' THEN
    RETURN NULL;
  END IF;
  DELETE FROM job_keys WHERE dedup_key = OLD.dedup_key AND job_id = OLD.id;
  RETURN NULL;
END
$$;

CREATE TRIGGER jobs_key_insert BEFORE INSERT ON jobs
  FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL AND NEW.status::text IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_take();
-- OF status, finished_at: every statement of ours that ends or requeues a job sets
-- finished_at, and one of yours that sets the status by hand is seen too.
CREATE TRIGGER jobs_key_requeue BEFORE UPDATE OF status, finished_at ON jobs
  FOR EACH ROW WHEN (NEW.dedup_key IS NOT NULL AND OLD.status::text NOT IN ('queued', 'running')
                     AND NEW.status::text IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_take();
CREATE TRIGGER jobs_key_delete AFTER DELETE ON jobs
  FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_free();
CREATE TRIGGER jobs_key_end AFTER UPDATE OF status, finished_at ON jobs
  FOR EACH ROW WHEN (OLD.dedup_key IS NOT NULL AND OLD.status::text IN ('queued', 'running')
                     AND NEW.status::text NOT IN ('queued', 'running'))
  EXECUTE FUNCTION jobs_key_free();

-- The same enqueue from SQL, now that no unique index decides: the trigger above does.
CREATE OR REPLACE FUNCTION enqueue(
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

-- The columns of jobs but gen, as a list: the moves below copy every one of them.
CREATE FUNCTION job_columns() RETURNS text LANGUAGE sql STABLE
SET search_path FROM CURRENT AS $$
  SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute
   WHERE attrelid = 'jobs'::regclass AND attnum > 0 AND NOT attisdropped AND attname <> 'gen'
$$;

-- Moves of rows between the partitions (src/asyncjobq/_maintenance/rotation.py), with the
-- owner's rights: TRUNCATE needs them, and the triggers' `asyncjobq.moving`. Each reads the
-- current generation under a row lock (a switch takes it FOR UPDATE): a leader that has not
-- seen the last switch cannot move rows the wrong way, and a move waits for a switch in
-- flight. READ COMMITTED only: each statement must see what committed before it (a row
-- inserted into the partition while the switch waited for its lock is moved, not truncated).
CREATE FUNCTION jobs_move(src smallint, dst smallint, which text, n int) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  moved bigint;
  sent int;
BEGIN
  PERFORM set_config('asyncjobq.moving', 'on', true);
  -- Rows a statement holds are left where they are (SKIP LOCKED); the queued ones in claim
  -- order. Their queues' workers are woken, with the lanes, as an insert would.
  EXECUTE format(
    'WITH m AS (DELETE FROM %1$I WHERE id = ANY(ARRAY(SELECT id FROM %1$I WHERE %5$s'
    '   ORDER BY priority DESC, run_at, id LIMIT %6$s FOR UPDATE SKIP LOCKED)) RETURNING *),'
    ' i AS (INSERT INTO %2$I (%3$s, gen) SELECT %3$s, %4$s FROM m'
    '   RETURNING queue, priority, run_at, status)'
    ' SELECT count(*), notify_lanes(%7$L, array_agg(queue) FILTER (WHERE status = ''queued''),'
    '   array_agg(priority) FILTER (WHERE status = ''queued''),'
    '   array_agg(run_at) FILTER (WHERE status = ''queued'')) FROM i',
    'jobs_' || src, 'jobs_' || dst, job_columns(), dst, which, n,
    current_schema() || '_jobs')
    INTO moved, sent;
  PERFORM set_config('asyncjobq.moving', 'off', true);
  RETURN moved;
END
$$;

CREATE FUNCTION jobs_read_committed() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'moving jobs between generations needs READ COMMITTED, not %',
      current_setting('transaction_isolation')
      USING ERRCODE = 'feature_not_supported',
            HINT = 'run it in a transaction of READ COMMITTED (the leader does)';
  END IF;
END
$$;

-- Up to `n` rows of the partition that is not current that satisfy `which`, into the current
-- one (the generation read under a share lock: a switch waits for the move, and a leader that
-- has not seen the last switch cannot move rows the wrong way).
CREATE FUNCTION jobs_move_to_current(which text, n int) RETURNS bigint LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  cur smallint;
BEGIN
  PERFORM jobs_read_committed();
  SELECT g.gen INTO cur FROM generation g FOR SHARE;
  RETURN jobs_move((1 - cur)::smallint, cur, which, n);
END
$$;

-- The leader's sweep: up to `n` queued rows of the partition that is not current into the
-- current one (an insert begun before the switch, a retry or snooze of a job claimed before
-- it, a workflow's child released there, the rest of the old one's backlog after a switch).
CREATE FUNCTION move_queued_jobs(n int) RETURNS bigint LANGUAGE sql
SECURITY DEFINER SET search_path FROM CURRENT
AS $$ SELECT jobs_move_to_current('status = ''queued''', n) $$;

-- Before a switch, in transactions of their own that lock nothing but the rows they move: up
-- to `n` live rows of the partition the switch will empty (whatever their status: failed,
-- waiting, delayed, running) into the current one, so that the switch itself, which holds
-- the partition ACCESS EXCLUSIVE, has little left to move.
CREATE FUNCTION drain_old_jobs(n int) RETURNS bigint LANGUAGE sql
SECURITY DEFINER SET search_path FROM CURRENT
AS $$ SELECT jobs_move_to_current('true', n) $$;

-- The switch: the other partition locked ACCESS EXCLUSIVE without waiting (NOWAIT: a
-- request queued behind a session's lock would hold up every statement through `jobs`
-- behind it), what is left of its live rows moved to the current one, TRUNCATE (no vacuum,
-- no horizon), made current, and the old one's best `n` queued rows moved into it; the sweep
-- moves the rest. -1: a lock was not free (another leader switching, a session holding the
-- partition), nothing changed. A running job moved keeps its id, attempt and lease: its
-- worker's completion, addressed to the partition it claimed from, finds nothing there and
-- looks again through `jobs` (_worker/completer.py). Notifies <schema>_gen.
CREATE FUNCTION rotate_jobs(n int) RETURNS bigint LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
  cur smallint;
  old smallint;
  moved bigint;
BEGIN
  PERFORM jobs_read_committed();
  BEGIN
    SELECT g.gen INTO cur FROM generation g FOR UPDATE NOWAIT;
    old := 1 - cur;
    EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', 'jobs_' || old);
  EXCEPTION WHEN lock_not_available THEN
    RETURN -1;
  END;
  moved := jobs_move(old, cur, 'true', 2147483647);
  EXECUTE format('TRUNCATE %I', 'jobs_' || old);
  UPDATE generation SET gen = old, switched_at = now(), switches = switches + 1;
  moved := moved + jobs_move(cur, old, 'status = ''queued''', n);
  PERFORM pg_notify(current_schema() || '_gen', old::text);
  RETURN moved;
END
$$;
REVOKE EXECUTE ON FUNCTION jobs_move(smallint, smallint, text, int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION jobs_move_to_current(text, int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION rotate_jobs(int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION move_queued_jobs(int) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drain_old_jobs(int) FROM PUBLIC;
