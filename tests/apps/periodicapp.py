"""An app with periodic schedules, for worker processes and the `schedules` command
(tests/test_periodic.py): an every-second interval and a 6-field cron every two seconds."""

from __future__ import annotations

import os

from asyncjobq import Job, Queue

queue = Queue(schema=os.environ.get("ASYNCJOBQ_TEST_SCHEMA", "asyncjobq"))


@queue.task(name="every_second")
async def every_second(job: Job) -> None:
    pass


@queue.task(name="cron_2s")
async def cron_2s(job: Job) -> None:
    pass


queue.periodic("every_second", every=1, name="every-second", payload={"from": "every"})
queue.periodic(cron_2s, cron="*/2 * * * * *", name="cron-2s", timezone="Europe/Paris")
