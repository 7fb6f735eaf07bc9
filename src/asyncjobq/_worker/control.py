"""What a worker lends the jobs it runs (job.JobControl): whether Queue.cancel asked for an
attempt to stop, and where its progress goes. One per worker, not one per job: a job that uses
neither costs nothing."""

from __future__ import annotations

from .executor import CANCEL_REQUESTED
from .progress import ProgressWriter
from .running import Running


class Control:
    def __init__(self, running: Running, progress: ProgressWriter) -> None:
        self._running = running
        self._progress = progress

    def cancel_requested(self, job_id: int, attempt: int) -> bool:
        # Any thread (sync handlers): one dict lookup.
        r = self._running.get((job_id, attempt))
        return r is not None and r.cancel_reason == CANCEL_REQUESTED

    def set_progress(self, job_id: int, attempt: int, value: str) -> None:
        self._progress.put(job_id, attempt, value)

    def cancel_notified(self, payload: str) -> None:
        """A notification on <schema>_cancel: the id of a job whose cancel was asked for."""
        try:
            job_id = int(payload)
        except ValueError:
            return  # not Queue.cancel's: ignored
        self._running.cancel_requested(ids={job_id})
