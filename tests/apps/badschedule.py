"""An app whose schedules are wrong in the way $ASYNCJOBQ_TEST_BAD names
(tests/test_periodic.py: the CLI must say so in one line and exit 2)."""

from __future__ import annotations

import os

from asyncjobq import Job, Queue

queue = Queue()
case = os.environ.get("ASYNCJOBQ_TEST_BAD", "")


@queue.task(name="job")
async def job(job: Job) -> None:
    pass


if case == "expression":
    queue.periodic("job", cron="61 * * * *")
elif case == "fields":
    queue.periodic("job", cron="* * *")
elif case == "timezone":
    queue.periodic("job", cron="0 3 * * *", timezone="Mars/Olympus_Mons")
elif case == "every":
    queue.periodic("job", every=0.5)
elif case == "both":
    queue.periodic("job", cron="0 3 * * *", every=60)
elif case == "neither":
    queue.periodic("job")
elif case == "duplicate":
    queue.periodic("job", every=60, name="twice")
    queue.periodic("job", cron="@hourly", name="twice")
elif case == "unknown-task":
    queue.periodic("no_such_task", every=60)
elif case == "decorator":
    @queue.task(name="nightly", cron="0 25 * * *")
    async def nightly(job: Job) -> None:
        pass
