-- asyncjobq schema, version 6: paused queues (Queue.pause / Queue.resume, CLI pause / resume).
-- Every claim skips a queue that has a row here (one primary-key probe per claimed queue, see
-- sql/claim.py); its running jobs finish. A row, not a flag on the jobs: pausing is one
-- committed insert however many jobs wait, and jobs enqueued meanwhile are held too.
CREATE TABLE paused_queues (
  queue     text        PRIMARY KEY,
  paused_at timestamptz NOT NULL DEFAULT now()
);
