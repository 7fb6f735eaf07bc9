"""3. I/O-bound jobs: each handler awaits asyncio.sleep(5 ms); one worker process."""

from __future__ import annotations

from typing import Any

from .common import Server
from .drain import drain

SLEEP = 0.005


def cells(server: Server, jobs: int, settings: list[tuple[int, int]]) -> list[tuple[str, Any]]:
    """settings: (concurrency, batch) pairs; batch 0 is the Worker's default."""
    return [(f"io c={c} b={b or 'default'}",
             lambda c=c, b=b: drain(server, "bench_io", jobs, 1, concurrency=c, batch=b,
                                    sleep=SLEEP))
            for c, b in settings]
