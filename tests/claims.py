"""The claims log used to count double claims: one row per handler execution."""

CREATE_CLAIMS = (
    "CREATE TABLE {s}.claims (job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL,"
    " worker text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
DOUBLE_CLAIMS = (
    "SELECT count(*) FROM (SELECT job_id, attempt FROM {s}.claims"
    " GROUP BY job_id, attempt HAVING count(*) > 1) d"
)
