-- asyncjobq schema, version 16: the partitions of jobs notify their inserts, as jobs does.
--
-- A producer's batch inserts (the coalesced enqueue() calls, enqueue_many) name the current
-- generation's partition, jobs_0 or jobs_1, instead of jobs (_db/sql/enqueue.py): PostgreSQL
-- then routes no row, which cost the server about 0.5 µs a row and the routing's set-up in
-- every statement (about 10 % of a 100,000-row enqueue_many). A statement-level trigger fires
-- only for the table a statement names, so each partition gets the notification trigger of
-- jobs. Not for the moves between the partitions (rotate_jobs, move_queued_jobs, with
-- `asyncjobq.moving` on): they notify the queued rows they move themselves, and this trigger
-- would name every row moved, running and failed ones too, lowering workers' floors
-- (_worker/floors.py) to their old run_at.
SELECT set_config('search_path', quote_ident(current_schema()) || ', pg_temp', true);

CREATE TRIGGER jobs_notify AFTER INSERT ON jobs_0
  REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT WHEN (current_setting('asyncjobq.moving', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION jobs_notify();
CREATE TRIGGER jobs_notify AFTER INSERT ON jobs_1
  REFERENCING NEW TABLE AS new_jobs
  FOR EACH STATEMENT WHEN (current_setting('asyncjobq.moving', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION jobs_notify();
