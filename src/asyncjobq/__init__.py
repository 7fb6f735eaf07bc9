"""asyncjobq: an asyncio job queue on PostgreSQL. See docs/index.md.

`__all__` is the supported surface of the package itself, with the modules testing, hooks,
metrics, tracing and dashboard (docs/reference/api.md says what else is machinery).
"""

from .errors import (
    AppImportError,
    AsyncJobQError,
    ConfigurationError,
    DatabaseUnavailableError,
    EmbeddedUnavailableError,
    EnqueueConnectionError,
    EnqueueRefusedError,
    InvalidPayloadError,
    JobCancelledError,
    JobFailedError,
    JobNotFoundError,
    QueueClosedError,
    RetryRaceError,
    SchemaNotInstalledError,
    SchemaVersionError,
)
from .job import Fail, Job, JobInfo, Retry, RetryResult
from .queue import Queue
from .retention import Retention
from .schedule import Schedule
from .task import Task
from .worker import Worker
from .workflow import Step, Workflow

__version__ = "0.1.0"

__all__ = [
    "AppImportError",
    "AsyncJobQError",
    "ConfigurationError",
    "DatabaseUnavailableError",
    "EmbeddedUnavailableError",
    "EnqueueConnectionError",
    "EnqueueRefusedError",
    "Fail",
    "InvalidPayloadError",
    "Job",
    "JobCancelledError",
    "JobFailedError",
    "JobInfo",
    "JobNotFoundError",
    "Queue",
    "QueueClosedError",
    "Retention",
    "Retry",
    "RetryRaceError",
    "RetryResult",
    "Schedule",
    "SchemaNotInstalledError",
    "SchemaVersionError",
    "Step",
    "Task",
    "Worker",
    "Workflow",
    "__version__",
]
