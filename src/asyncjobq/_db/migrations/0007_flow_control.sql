-- asyncjobq schema, version 7: flow control (docs/guides/flow-control.md): fleet-wide concurrency limits, per-key
-- serial execution and rate limits, enforced inside the claim (sql/claim.py, the `_limited`
-- statements). Limits live in the workers' code and come with every claim as a parameter, so
-- a limit changed in code takes effect when the workers restart; nothing here stores them.

-- The job's key (enqueue(key=...)): jobs of one task with one key run at most key_limit at
-- once, in claim order. Nullable without a default: added without rewriting the table.
ALTER TABLE jobs ADD COLUMN key text;
ALTER TABLE jobs_history ADD COLUMN key text;
-- Set by a limited claim on the rows it starts of a limited task: the running rows a limit
-- counts are found through jobs_flow_running_idx, whose entries only limited jobs make, so
-- claims and completions of other jobs write no extra index entry.
ALTER TABLE jobs ADD COLUMN flow boolean NOT NULL DEFAULT false;

CREATE INDEX jobs_flow_running_idx ON jobs (task, key) WHERE status = 'running' AND flow;
-- A key's first new waiting jobs, in claim order: its next job is their head.
CREATE INDEX jobs_key_queued_idx ON jobs (task, key, priority DESC, run_at, id)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts = 0;
-- A key's jobs waiting for another attempt: they keep their key's slot (flow_admit).
CREATE INDEX jobs_key_retrying_idx ON jobs (task, key)
  WHERE status = 'queued' AND key IS NOT NULL AND attempts > 0;

-- Starts of rate-limited tasks, a sliding log: a rate limit of N per period admits a start
-- while fewer than N were logged in the last period. Pruned by the claims that read it.
CREATE TABLE flow_starts (
  task       text        NOT NULL,
  started_at timestamptz NOT NULL
) WITH (
  autovacuum_vacuum_scale_factor = 0.01,
  autovacuum_vacuum_threshold = 500,
  autovacuum_vacuum_cost_delay = 0
);
CREATE INDEX flow_starts_idx ON flow_starts (task, started_at);

-- Which of the claim's candidate rows (`ids`, already locked by it) may start now, given
-- `limits` ({task: {"c": concurrency, "k": key limit, "r": [n, period seconds]}}). The
-- claim's scan already left out rows its snapshot showed over a limit; this is the decision
-- that holds under races. Its locks serialise the claims of one limited task (or key) until
-- they commit, and, being VOLATILE, each of its queries reads a fresh snapshot: what every
-- earlier claim committed. The attempts of `out_ids`/`out_attempts`, held by `worker` and
-- ended by the same statement (a completion folded with the claim), no longer run; those of
-- them `out_final` (done, failed) no longer hold their key either. Returns the admitted ids,
-- how many candidates were held back, and when the first rate-limited one may start.
CREATE FUNCTION flow_admit(
  ids bigint[], limits jsonb, out_ids bigint[], out_attempts int[], out_final boolean[],
  worker text, OUT admitted bigint[], OUT held int, OUT retry_at timestamptz)
LANGUAGE plpgsql VOLATILE SET search_path FROM CURRENT AS $$
DECLARE
  c record;
  lim jsonb;
  t0 timestamptz;
  -- Counts so far, per limit: running (or logged, or holding a key) before this call, plus
  -- admitted by it.
  used jsonb := '{}';
  name text;
  kname text;
  n bigint;
  waiting bigint;
  started bigint;
  cap bigint;
  period interval;
  oldest timestamptz;
  head bigint[];
  rated text[] := '{}';
BEGIN
  -- Each query below must see what other claims committed while this one waited for its
  -- locks: only READ COMMITTED gives each its own snapshot.
  IF current_setting('transaction_isolation') <> 'read committed' THEN
    RAISE EXCEPTION 'asyncjobq: a claim with limits ran at isolation level %, where limits '
      'cannot hold', current_setting('transaction_isolation')
      USING HINT = 'set default_transaction_isolation to ''read committed'' for the workers'' '
                   'role or database (ALTER ROLE ... SET default_transaction_isolation ...)';
  END IF;
  admitted := '{}';
  held := 0;
  -- Every lock this call needs, first and in one order: two claims taking them in candidate
  -- order could each wait for the other's.
  PERFORM pg_advisory_xact_lock(k) FROM (
    SELECT DISTINCT hashtextextended(current_schema() || ' flow ' || l, 0) AS k FROM (
      SELECT jsonb_build_array(j.task)::text AS l FROM jobs j
       WHERE j.id = ANY(ids) AND (limits -> j.task) ?| ARRAY['c', 'r']
      UNION ALL
      SELECT jsonb_build_array(j.task, j.key)::text FROM jobs j
       WHERE j.id = ANY(ids) AND j.key IS NOT NULL AND (limits -> j.task) ? 'k') x) y
  ORDER BY k;
  -- After the locks: a start is logged at the time it was decided, not when its claim began
  -- waiting for them.
  t0 := clock_timestamp();

  FOR c IN SELECT j.id, j.task, j.key, j.priority, j.run_at, j.attempts FROM jobs j
            WHERE j.id = ANY(ids) ORDER BY j.priority DESC, j.run_at, j.id LOOP
    lim := limits -> c.task;
    IF lim IS NULL THEN
      admitted := admitted || c.id;
      CONTINUE;
    END IF;

    IF lim ? 'c' THEN
      name := jsonb_build_array('c', c.task)::text;
      n := (used ->> name)::bigint;
      IF n IS NULL THEN
        -- Rows this statement's completions finish (the same attempt, held by this worker)
        -- no longer run.
        SELECT count(*) INTO n FROM jobs r
         WHERE r.task = c.task AND r.status = 'running' AND r.flow
           AND NOT (r.locked_by = worker AND EXISTS (
             SELECT FROM unnest(out_ids, out_attempts) AS o(id, attempt)
              WHERE o.id = r.id AND o.attempt = r.attempts));
        used := used || jsonb_build_object(name, n);
      END IF;
      IF n >= (lim ->> 'c')::bigint THEN
        held := held + 1;
        CONTINUE;
      END IF;
    END IF;

    IF lim ? 'r' THEN
      name := jsonb_build_array('r', c.task)::text;
      -- A start counts for its period plus 50 ms, more than it takes to reach its handler
      -- (commit, reply, dispatch): the handlers do not see N + 1 starts in one period either.
      period := make_interval(secs => (lim -> 'r' ->> 1)::float8 + 0.05);
      n := (used ->> name)::bigint;
      IF n IS NULL THEN
        DELETE FROM flow_starts s WHERE s.task = c.task AND s.started_at <= t0 - period;
        SELECT count(*) INTO n FROM flow_starts s
         WHERE s.task = c.task AND s.started_at > t0 - period;
        used := used || jsonb_build_object(name, n);
      END IF;
      IF n >= (lim -> 'r' ->> 0)::bigint THEN
        held := held + 1;
        SELECT min(s.started_at) + period INTO oldest FROM flow_starts s
         WHERE s.task = c.task AND s.started_at > t0 - period;
        retry_at := least(retry_at, coalesce(oldest, t0 + period));
        CONTINUE;
      END IF;
    END IF;

    IF c.key IS NOT NULL AND lim ? 'k' THEN
      kname := jsonb_build_array('k', c.task, c.key)::text;
      cap := (lim ->> 'k')::bigint;
      IF NOT used ? kname THEN
        -- A key's holders: its running jobs (but those this statement ends for good, done or
        -- failed), and its jobs waiting for another attempt: a job being retried keeps its
        -- place, the key's next new job waits for it.
        SELECT count(*) INTO n FROM jobs r
         WHERE r.task = c.task AND r.key = c.key AND r.status = 'running' AND r.flow
           AND NOT (r.locked_by = worker AND EXISTS (
             SELECT FROM unnest(out_ids, out_attempts, out_final) AS o(id, attempt, final)
              WHERE o.id = r.id AND o.attempt = r.attempts AND o.final));
        SELECT count(*) INTO waiting FROM jobs q
         WHERE q.task = c.task AND q.key = c.key AND q.status = 'queued' AND q.attempts > 0;
        used := used || jsonb_build_object(kname, n, kname || ' waiting', waiting,
                                           kname || ' admitted', 0);
      END IF;
      n := (used ->> kname)::bigint;
      waiting := (used ->> (kname || ' waiting'))::bigint;
      started := (used ->> (kname || ' admitted'))::bigint;
      IF c.attempts > 0 THEN
        -- A holder already: it runs again when the key's running jobs leave it room (several
        -- waiting ones take their turns in claim order), whatever the other waiting ones.
        IF n + started >= cap THEN
          held := held + 1;
          CONTINUE;
        END IF;
      ELSE
        -- A new job starts from the key's first due new jobs, as many as the key has free
        -- slots: one key's jobs start in claim order (priority, run_at, id).
        SELECT array_agg(e.id) INTO head FROM (
          SELECT e.id FROM jobs e
           WHERE e.task = c.task AND e.key = c.key AND e.status = 'queued'
             AND e.attempts = 0 AND e.run_at <= t0
           ORDER BY e.priority DESC, e.run_at, e.id
           LIMIT greatest(0, cap - n - waiting)) e;
        IF n + waiting + started >= cap OR NOT c.id = ANY(coalesce(head, '{}')) THEN
          held := held + 1;
          CONTINUE;
        END IF;
      END IF;
      used := used || jsonb_build_object(kname || ' admitted', started + 1);
    END IF;

    IF lim ? 'c' THEN
      name := jsonb_build_array('c', c.task)::text;
      used := used || jsonb_build_object(name, (used ->> name)::bigint + 1);
    END IF;
    IF lim ? 'r' THEN
      name := jsonb_build_array('r', c.task)::text;
      used := used || jsonb_build_object(name, (used ->> name)::bigint + 1);
      rated := rated || c.task;
    END IF;
    admitted := admitted || c.id;
  END LOOP;

  IF cardinality(rated) > 0 THEN
    INSERT INTO flow_starts (task, started_at) SELECT r, t0 FROM unnest(rated) AS r;
  END IF;
END
$$;
