-- asyncjobq schema, version 8: indexes for browsing jobs (the dashboard's jobs list, through
-- Queue.list_jobs). Newest first with `id < before` (keyset pages): history is read per
-- (queue, status) pair (with the task when one is given), each branch stopping after a page
-- of rows, so a page costs the same at 10,000 or 10,000,000 history rows. Without them a
-- filter on a rare queue, task or status read history backwards until it found a page.
-- Each completed job pays two more index entries in history; the live table gets only
-- partial indexes that hold failed rows, which no claim or completion of a healthy job touches.
-- Building them on an existing history holds its writers (completions) back meanwhile: about
-- 10 s per 10,000,000 rows.
--
-- Lock order: every migration runs in one transaction, so each lock taken here is held to the
-- end. A completion locks jobs first (RowExclusive, its DELETE) and then jobs_history (its
-- INSERT). The indexes on jobs are therefore built FIRST: their SHARE lock on jobs is taken
-- before any lock on jobs_history, in the order completions take them. A completion then waits
-- on jobs holding nothing on history, and the history builds cannot wait for it. Built the
-- other way round, a completion holding jobs and waiting on history (SHARE, held by a build)
-- and this transaction waiting on jobs for that completion deadlock.
--
-- Failed (dead-lettered) jobs by id, for the jobs list's keyset pages of status=failed.
CREATE INDEX jobs_failed_id_idx ON jobs (id) WHERE status = 'failed';
-- Failed jobs by when they failed, for the throughput chart's failures.
CREATE INDEX jobs_failed_browse_idx ON jobs (finished_at) WHERE status = 'failed';
CREATE INDEX jobs_history_queue_browse_idx ON jobs_history (queue, status, id);
CREATE INDEX jobs_history_task_browse_idx ON jobs_history (task, queue, status, id);
