-- asyncjobq schema, version 2: the leader.
-- One row while a worker leads this schema: the worker that runs the once-per-fleet
-- maintenance services (reaper, pruner, hot-table vacuum). It renews expires_at every third of
-- its lease; a worker that stops renewing (stopped, killed, cut off) is replaced by another
-- once the row has expired. See docs/how-it-works/leader.md.
CREATE TABLE leader (
  name       text        PRIMARY KEY DEFAULT 'default' CHECK (name = 'default'),
  worker     text        NOT NULL,
  elected_at timestamptz NOT NULL DEFAULT now(),
  expires_at timestamptz NOT NULL
);
