"""Flow control: at most 14 mails a second across every worker (the provider's limit), at most
3 exports at once, and each account's transfers one at a time, in the order they were made.

    python -m asyncjobq worker examples.flow_control:queue   # on as many hosts as you like
    python -m asyncjobq status examples.flow_control:queue   # the limits and their use now
"""

from __future__ import annotations

import os

import asyncjobq

queue = asyncjobq.Queue(schema=os.environ.get("QUEUE_SCHEMA", "asyncjobq"))
applied: list[tuple[int, int]] = []  # (account, seq), in the order transfers ran


@queue.task(name="send_mail", rate_limit="14/s")
async def send_mail(job: asyncjobq.Job) -> None:
    print("mail to", job.payload["to"])


@queue.task(name="export", concurrency_limit=3)
async def export(job: asyncjobq.Job) -> None:
    print("exporting", job.payload["report"])


@queue.task(name="transfer", key_limit=1)
async def transfer(job: asyncjobq.Job) -> None:
    applied.append((job.payload["account"], job.payload["seq"]))


async def enqueue_transfers(account: int, amounts: list[int]) -> list[int]:
    """One job per transfer, keyed by account: they run one at a time, in this order."""
    return await queue.enqueue_many(
        "transfer",
        [{"account": account, "seq": i, "amount": a} for i, a in enumerate(amounts)],
        keys=[f"account:{account}"] * len(amounts))
