-- asyncjobq schema, version 9: notifications name their lanes.
-- Workers claim each (queue, priority) lane from a floor, a (run_at, id) below which they saw
-- no queued row, so that a pinned xmin horizon's dead index entries behind it are never read
-- again (_worker/floors.py, docs/how-it-works/storage.md). A row inserted below a floor must
-- lower it: each notification now carries, besides the queue's earliest run_at, the earliest
-- run_at of each priority the statement wrote. Replacing the function takes no lock on jobs.
CREATE OR REPLACE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify(
    TG_TABLE_SCHEMA || '_jobs',
    json_build_object('queue', l.queue, 'run_at', extract(epoch FROM min(l.at)),
                      -- Past 100 lanes the payload would near the 8,000-byte limit: none
                      -- (the workers then walk the queue's lanes again).
                      'lanes', CASE WHEN count(*) <= 100 THEN
                        json_agg(json_build_array(l.priority, extract(epoch FROM l.at))) END)::text)
  FROM (SELECT n.queue, n.priority, min(n.run_at) AS at FROM new_jobs n
        GROUP BY n.queue, n.priority) l
  GROUP BY l.queue;
  RETURN NULL;
END
$$;
