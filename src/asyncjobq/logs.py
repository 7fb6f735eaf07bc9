"""Log lines as JSON, one object per line (`python -m asyncjobq worker --log-format json`), for
log pipelines that parse them (docs/guides/deploying.md).

Each object has `ts` (ISO 8601, UTC), `level`, `logger` and `message`; `worker` (the worker's id)
on a worker's lines; `job_id`, `task`, `queue`, `attempt` on lines about a job: those logged
while its handler runs (the handler's own lines too, sync handlers included) and those the
worker writes about it elsewhere; `exc` with a traceback when there is one.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from . import job as job_module
from .job import current_job

__all__ = ["JsonFormatter"]

_JOB_FIELDS = ("job_id", "task", "queue", "attempt")


class JsonFormatter(logging.Formatter):
    """One JSON object per record.

    Args:
        worker: the worker id to put on every line (`Worker.id`), or None.
    """

    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self.worker = worker
        job_module.TRACK_CURRENT_JOB = True  # workers now name the job in each handler's context

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        job = current_job.get()
        if job is not None:
            out.update(job_id=job.id, task=job.task, queue=job.queue, attempt=job.attempt)
        for name in _JOB_FIELDS:  # a line about a job, logged outside its handler
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # default=str: a message's arguments are formatted already; this is for the odd
        # extra= value a handler passes that JSON cannot hold.
        return json.dumps(out, ensure_ascii=False, default=str)
