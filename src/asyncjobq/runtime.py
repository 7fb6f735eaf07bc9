"""Running a coroutine on the best loop available: uvloop when installed, else asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    return anyio.run(fn, *args, backend="asyncio",
                     backend_options={"loop_factory": loop_factory()})
