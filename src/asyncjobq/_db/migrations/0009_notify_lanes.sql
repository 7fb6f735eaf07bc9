-- asyncjobq schema, version 9: notifications name their lanes.
-- Workers may claim each (queue, priority) lane from a floor, a (run_at, id) below which they
-- saw no queued row, so that a pinned xmin horizon's dead index entries behind it are not read
-- again (_worker/floors.py, docs/how-it-works/storage.md). A row made queued below a floor must
-- lower it: each notification now carries, besides the queue's earliest run_at, the earliest
-- run_at of each priority written. Creating and replacing functions takes no lock on jobs.

-- One notification per queue of the rows (queues[i], priorities[i], run_ats[i]), for every
-- statement that makes rows queued (jobs_notify below; _db/sql/common.py, notify_lanes). Past
-- 100 lanes the payload would near PostgreSQL's 8,000 bytes: it names none, and workers walk
-- the queue's lanes again. STRICT: a statement that made no row queued passes NULL arrays and
-- sends nothing. Returns how many it sent.
CREATE FUNCTION notify_lanes(channel text, queues text[], priorities int[], run_ats timestamptz[])
RETURNS int LANGUAGE sql STRICT VOLATILE AS $$
  SELECT count(*)::int FROM (
    SELECT pg_notify(channel, json_build_object(
             'queue', l.queue, 'run_at', extract(epoch FROM min(l.at)),
             'lanes', CASE WHEN count(*) <= 100 THEN
               json_agg(json_build_array(l.priority, extract(epoch FROM l.at))) END)::text)
    FROM (SELECT r.queue, r.priority, min(r.run_at) AS at
          FROM unnest(queues, priorities, run_ats) AS r(queue, priority, run_at)
          GROUP BY r.queue, r.priority) l
    GROUP BY l.queue) n
$$;

-- The same notifications, written out: calling notify_lanes() from here would need the
-- schema on the producer's search_path, or a SET clause that every insert statement pays for.
CREATE OR REPLACE FUNCTION jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify(
    TG_TABLE_SCHEMA || '_jobs',
    json_build_object('queue', l.queue, 'run_at', extract(epoch FROM min(l.at)),
                      'lanes', CASE WHEN count(*) <= 100 THEN
                        json_agg(json_build_array(l.priority, extract(epoch FROM l.at))) END)::text)
  FROM (SELECT n.queue, n.priority, min(n.run_at) AS at FROM new_jobs n
        GROUP BY n.queue, n.priority) l
  GROUP BY l.queue;
  RETURN NULL;
END
$$;
