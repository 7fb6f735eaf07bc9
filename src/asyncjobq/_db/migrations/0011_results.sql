-- asyncjobq schema, version 11: results, waits, progress, cancelling running jobs
-- (docs/guides/results.md). Every column is nullable without a default: adding one changes the
-- catalog only (no rewrite, ACCESS EXCLUSIVE for an instant), and a NULL costs a row nothing
-- beyond the null bitmap every row of these tables already has.
--
-- jobs.waited: true once a `Queue.wait` looks for the job; the statements that make a job
--   final (the completion flush, cancel, the reaper) notify <schema>_done with its id then,
--   and only then: a job nobody waits for costs no notification.
-- jobs.cancel_requested_at: when `Queue.cancel` asked for a running job to stop; its worker
--   hears of it on <schema>_cancel (and from its heartbeat's reply), the reaper cancels it
--   instead of requeueing it when its worker died.
-- progress (both tables): the last value a handler passed to `job.set_progress`.
-- jobs_history.result: what the handler returned (JSON), for `done` jobs.
ALTER TABLE jobs ADD COLUMN waited boolean, ADD COLUMN cancel_requested_at timestamptz,
  ADD COLUMN progress jsonb;
ALTER TABLE jobs_history ADD COLUMN result jsonb, ADD COLUMN progress jsonb;
