"""Getting started's first job: a task that greets whoever the payload names.

    python -m asyncjobq worker examples.hello:queue
    python -m asyncjobq enqueue greet --payload '{"name": "Ada"}'
"""

import asyncjobq

queue = asyncjobq.Queue()  # $ASYNCJOBQ_DSN, else the embedded PostgreSQL under ./.asyncjobq/


@queue.task(name="greet")
async def greet(job: asyncjobq.Job) -> None:
    print(f"hello, {job.payload['name']}", flush=True)
