"""Fault drills: worker processes on one queue, thousands of jobs whose handlers log
(job_id, attempt, pid), a fault, and the count at the end.

Set $ASYNCJOBQ_DRILL_REPORT to a file path to get one JSON line per drill with the figures.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from claims import CREATE_CLAIMS, DOUBLE_CLAIMS
from conftest import WorkerProcess, execute, fetchval, spawn_worker, wait_for

from asyncjobq import Queue

WORKER_ARGS = ("--lease", "2", "--concurrency", "10", "--batch", "10", "--poll-interval", "0.5")


@dataclass
class DrillResult:
    fault: str
    jobs: int
    lost: int
    double_claims: int
    reexecutions: int
    drain_seconds: float


class Drill:
    def __init__(self, queue: Queue, dsn: str, fault: str, *, jobs: int = 2000,
                 seconds: float = 0.02) -> None:
        self.queue = queue
        self.dsn = dsn
        self.fault = fault
        self.jobs = jobs
        self.seconds = seconds
        self.procs: list[WorkerProcess] = []
        self.fault_ended = 0.0

    async def setup(self) -> None:
        await execute(self.queue, CREATE_CLAIMS)
        await self.queue.enqueue_many("sleep", [{"seconds": self.seconds}] * self.jobs,
                                      max_attempts=100)

    async def enqueue_extra(self, n: int, payload: dict[str, Any], **options: Any) -> list[int]:
        """Jobs besides the drill's bulk (counted in its totals too)."""
        ids = await self.queue.enqueue_many("sleep", [payload] * n, max_attempts=100, **options)
        self.jobs += n
        return ids

    def start_worker(self, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        p = spawn_worker(self.dsn, self.queue.schema, *WORKER_ARGS, *args, env=env)
        self.procs.append(p)
        return p

    def stderr(self, p: WorkerProcess) -> str:
        """What the worker has written to stderr so far."""
        return p.stderr_so_far()

    def wait(self, p: WorkerProcess, timeout: float = 30) -> tuple[int, str]:
        """Waits for the worker to exit; returns (returncode, stderr)."""
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err

    def live(self) -> list[WorkerProcess]:
        return [p for p in self.procs if p.poll() is None]

    async def executed(self) -> int:
        return int(await fetchval(self.queue, "SELECT count(DISTINCT job_id) FROM {s}.claims"))

    async def finished(self) -> bool:
        return bool(await fetchval(self.queue, "SELECT count(*) = 0 FROM {s}.jobs"))

    async def drain(self, timeout: float = 120) -> DrillResult:
        start = self.fault_ended or time.monotonic()
        await wait_for(self.finished, timeout=timeout, interval=0.1, what=f"{self.fault}: drain")
        drained = time.monotonic() - start
        stats = await self.queue.stats()
        done = sum(counts["done"] for counts in stats.values())
        executions = int(await fetchval(self.queue, "SELECT count(*) FROM {s}.claims"))
        result = DrillResult(
            fault=self.fault, jobs=self.jobs, lost=self.jobs - done,
            double_claims=int(await fetchval(self.queue, DOUBLE_CLAIMS)),
            reexecutions=executions - self.jobs, drain_seconds=round(drained, 2))
        report = os.environ.get("ASYNCJOBQ_DRILL_REPORT")
        if report:
            with Path(report).open("a") as f:  # noqa: ASYNC230 - one short line, once
                f.write(json.dumps(asdict(result)) + "\n")
        return result

    def stop(self) -> list[tuple[int, str]]:
        """Kill what still runs; returns (returncode, stderr) of every process."""
        out = []
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            out.append(self.wait(p))
        return out


def assert_all_alive(drill: Drill) -> None:
    """Every worker still runs; else what an exited one wrote last."""
    for p in drill.procs:
        if p.poll() is not None:
            raise AssertionError(f"a worker exited ({p.returncode}):\n"
                                 f"{drill.stderr(p)[-3000:]}")


def assert_clean(result: DrillResult) -> None:
    assert result.lost == 0, result
    assert result.double_claims == 0, result


def no_tracebacks(outputs: list[tuple[int, str]]) -> None:
    for _, err in outputs:
        assert "Traceback" not in err, err[-3000:]


def backends(*app_names: str) -> Any:
    """SQL selecting the pids of the workers' connections (by application_name)."""
    names = ", ".join(f"'{n}'" for n in app_names)
    return ("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            f" AND application_name IN ({names})")
