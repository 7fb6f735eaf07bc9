-- asyncjobq schema, version 5: the W3C trace context of the enqueue that wrote a job
-- (asyncjobq.tracing), so that the worker's span of each attempt continues the producer's
-- trace in another process. NULL when the producer had no tracing, or wrote the job in SQL.
-- A nullable column without a default is added without rewriting the table, and costs
-- nothing where it stays NULL.
ALTER TABLE jobs ADD COLUMN trace_context jsonb;
