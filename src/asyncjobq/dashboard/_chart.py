"""The overview's throughput chart: inline SVG built on the server, one bar per minute.

SVG from the server needs no chart library and no script: it is part of the page the refresh
swaps in, and renders the same in a screenshot, a wall screen and a text-mode diff.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True)
class Bar:
    x: float
    done_y: float
    done_h: float
    failed_y: float
    failed_h: float
    title: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    peak: int
    total_done: int
    total_failed: int
    bar_width: float


def throughput_chart(rows: list[tuple[datetime, str, str, int]], *, minutes: int = 60,
                     now: datetime | None = None, width: int = 600,
                     height: int = 120) -> Chart:
    """Done and failed per minute for the last `minutes`, ending with the current minute."""
    now = (now or datetime.now(UTC)).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    done = [0] * minutes
    failed = [0] * minutes
    for at, _queue, status, n in rows:
        i = int((at.astimezone(UTC) - start).total_seconds() // 60)
        if 0 <= i < minutes:
            if status == "done":
                done[i] += n
            elif status == "failed":
                failed[i] += n
    peak = max([d + f for d, f in zip(done, failed, strict=True)] + [1])
    step = width / minutes
    bars = []
    for i in range(minutes):
        dh = height * done[i] / peak
        fh = height * failed[i] / peak
        label = (start + timedelta(minutes=i)).strftime("%H:%M")
        bars.append(Bar(round(i * step, 2), round(height - dh, 2), round(dh, 2),
                        round(height - dh - fh, 2), round(fh, 2),
                        f"{label} UTC: {done[i]} done, {failed[i]} failed"))
    return Chart(width, height, bars, peak, sum(done), sum(failed), round(step * 0.8, 2))
