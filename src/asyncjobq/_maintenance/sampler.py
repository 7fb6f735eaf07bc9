"""The queue-depth sampler (docs/reference/metrics.md): on the leader only, every `interval`
seconds, one read of the jobs by queue and status, handed to `publish` (the Prometheus gauge).
A scrape then reads memory: a fleet of workers scraped every few seconds does not become a
storm of count queries, and the database is asked once per interval whatever the number of
workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .services import Service

Counts = dict[str, dict[str, int]]


class DepthSampler(Service):
    name = "depth sampler"
    leader_only = True
    eager = True

    def __init__(self, sample: Callable[[], Awaitable[Counts]],
                 publish: Callable[[Counts], None], *, interval: float) -> None:
        self._sample = sample
        self._publish = publish
        self.interval = interval
        self.timeout = max(interval, 10.0)

    async def turn(self) -> None:
        self._publish(await self._sample())
