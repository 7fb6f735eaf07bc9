"""The maintenance runner (services.py): a turn that hangs is cut at its timeout, one that
raises anything (even a CancelledError of its own) is logged, and the other services go on."""

from __future__ import annotations

import asyncio
import logging

import pytest
from conftest import wait_for

from asyncjobq._maintenance.services import Service, ServiceRunner


class Counting(Service):
    def __init__(self, name: str, fail_first: BaseException | None = None,
                 hang_first: bool = False) -> None:
        self.name = name
        self.interval = 0.05
        self.max_backoff = 0.1
        self.timeout = 0.5
        self.turns = 0
        self._fail_first = fail_first
        self._hang_first = hang_first

    async def turn(self) -> None:
        self.turns += 1
        if self.turns == 1 and self._fail_first is not None:
            raise self._fail_first
        if self.turns == 1 and self._hang_first:
            await asyncio.Event().wait()


async def test_a_turn_raising_cancelled_or_hanging_ends_no_service(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncjobq")
    cancelled = Counting("cancels", fail_first=asyncio.CancelledError())
    hanging = Counting("hangs", hang_first=True)
    bystander = Counting("bystander")
    runner = ServiceRunner([cancelled, hanging, bystander])
    task = asyncio.create_task(runner.run())
    try:
        await wait_for(lambda: cancelled.turns >= 3 and hanging.turns >= 3, timeout=10,
                       what="both services turning again")
        assert not task.done()
        assert bystander.turns >= 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert "cancels turn failed (CancelledError" in caplog.text
    assert "hangs turn failed (the turn took more than 0.5 s and was cancelled)" in caplog.text
