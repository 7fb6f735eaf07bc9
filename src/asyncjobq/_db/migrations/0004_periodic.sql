-- asyncjobq schema, version 4: periodic jobs (src/asyncjobq/_maintenance/scheduler.py).
-- One row per tick the leader's scheduler recorded, inserted in the same statement as the
-- tick's job: the primary key is the database's guard that a tick is enqueued once, even by two
-- leaders for an instant. Ticks are computed from each schedule's latest row, never from a
-- process's memory. `enqueued` is false for the row that marks where a new schedule starts
-- (no backfill). The scheduler deletes rows older than a few minutes except each name's latest.
CREATE TABLE periodic_ticks (
  name       text        NOT NULL,
  tick       timestamptz NOT NULL,
  enqueued   boolean     NOT NULL DEFAULT true,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (name, tick)
) WITH (
  autovacuum_vacuum_scale_factor = 0.05,
  autovacuum_analyze_scale_factor = 0.05
);
