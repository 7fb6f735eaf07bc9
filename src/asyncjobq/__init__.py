"""asyncjobq: an asyncio job queue on PostgreSQL. See docs/index.md."""

from .errors import (
    AppImportError,
    AsyncJobQError,
    ConfigurationError,
    DatabaseUnavailableError,
    EmbeddedUnavailableError,
    EnqueueConnectionError,
    EnqueueRefusedError,
    InvalidPayloadError,
    QueueClosedError,
    RetryRaceError,
    SchemaNotInstalledError,
    SchemaVersionError,
)
from .job import Fail, Job, JobInfo, Retry, RetryResult
from .queue import Queue
from .task import Task
from .worker import Worker

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
    "JobInfo",
    "Queue",
    "QueueClosedError",
    "Retry",
    "RetryRaceError",
    "RetryResult",
    "SchemaNotInstalledError",
    "SchemaVersionError",
    "Task",
    "Worker",
    "__version__",
]
