"""8. Memory: one default worker's peak RSS draining a small vs a 10x larger backlog.

The handler records nothing (no per-job list in the benchmark process), so what grows is the
worker's own. Peak RSS is ru_maxrss of the worker process; RSS is also sampled every 0.5 s.
"""

from __future__ import annotations

from typing import Any

from .common import Server
from .drain import drain


def cells(server: Server, small: int, large: int) -> list[tuple[str, Any]]:
    return [(f"memory {n}", lambda n=n: drain(server, "bench_memory", n, 1, record="none"))
            for n in (small, large)]
