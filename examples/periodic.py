"""Periodic jobs: a nightly report at 03:00 Paris time and two cleanups, each tick enqueued
once however many workers run this app.

    python -m asyncjobq worker examples.periodic:queue      # as many as you like
    python -m asyncjobq schedules examples.periodic:queue   # last and next tick of each
"""

from __future__ import annotations

import os
from datetime import timedelta

import asyncjobq

queue = asyncjobq.Queue(schema=os.environ.get("QUEUE_SCHEMA", "asyncjobq"))


@queue.task(name="nightly_report", cron="0 3 * * *", timezone="Europe/Paris")
async def nightly_report(job: asyncjobq.Job) -> None:
    print("report for the night before", job.run_at)  # run_at is the tick's time


@queue.task(name="cleanup")
async def cleanup(job: asyncjobq.Job) -> None:
    print("cleaning", job.payload["scope"])


queue.periodic("cleanup", every=timedelta(seconds=30), payload={"scope": "tmp"},
               name="tmp-cleanup")
queue.periodic("cleanup", cron="*/15 * * * *", payload={"scope": "cache"}, name="cache-cleanup")
