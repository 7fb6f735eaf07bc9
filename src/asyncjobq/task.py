"""A registered handler and its defaults; `Task.enqueue` is the decorator's shorthand."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .job import Job

if TYPE_CHECKING:
    from psycopg import AsyncConnection

    from .queue import Queue

Handler = Callable[[Job], Awaitable[object]] | Callable[[Job], object]
Backoff = Callable[[int], float]


@dataclass(frozen=True)
class Task:
    owner: Queue
    name: str
    handler: Handler
    queue: str = "default"
    max_attempts: int = 3
    timeout: float | None = None
    priority: int = 0
    backoff: Backoff | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)

    async def enqueue(
        self,
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        dedup_key: str | None = None,
        conn: AsyncConnection[Any] | None = None,
    ) -> int:
        return await self.owner.enqueue(
            self.name,
            {} if payload is None else payload,
            queue=queue,
            priority=priority,
            run_at=run_at,
            delay=delay,
            max_attempts=max_attempts,
            dedup_key=dedup_key,
            conn=conn,
        )

    def __call__(self, job: Job) -> object:
        """Call the handler directly (handy in unit tests of the handler itself)."""
        return self.handler(job)
