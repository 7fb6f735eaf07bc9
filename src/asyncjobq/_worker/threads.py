"""Daemon threads of the worker's own for plain `def` handlers.

A thread cannot be interrupted: a sync handler past its timeout, or one the worker cancels, runs
on until it returns. The executor waits for it, so the job keeps its slot and its lease and no
other attempt of it starts meanwhile (executor.py), as long as the worker's event loop runs: a
loop blocked for a whole lease stops the heartbeats (heartbeat.py), and the fleet may then
start the job again while its thread still runs here. These threads are daemons so that a worker
that was asked to stop can still exit after its shutdown_timeout: a body that never returns
dies with the process, and its job, still `running` in the table, is reaped after the lease.
anyio's and asyncio's pool threads are joined at interpreter exit, which would hang instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

_Work = tuple[contextvars.Context, Callable[[Any], object], Any, asyncio.Future[object],
              asyncio.AbstractEventLoop]


class ThreadRunner:
    """Runs `fn(arg)` in a reused daemon thread; at most as many threads as bodies at once."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work that no submit() has counted on yet
        self._threads = 0
        self.busy = 0  # bodies running now, read on the loop (tests, logs)

    def submit(self, fn: Callable[[Any], object], arg: Any) -> asyncio.Future[object]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        self._work.put((contextvars.copy_context(), fn, arg, fut, loop))
        with self._lock:
            if self._idle:
                self._idle -= 1
                spawn = False
            else:
                self._threads += 1
                spawn = True
        if spawn:
            threading.Thread(target=self._serve, name=f"{self._name}-{self._threads}",
                             daemon=True).start()
        self.busy += 1
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut: asyncio.Future[object]) -> None:
        self.busy -= 1

    def close(self) -> None:
        """Let idle threads end; busy ones end when their body returns."""
        with self._lock:
            threads, self._threads, self._idle = self._threads, 0, 0
        for _ in range(threads):
            self._work.put(None)

    def _serve(self) -> None:
        while True:
            work = self._work.get()
            if work is None:
                return
            ctx, fn, arg, fut, loop = work
            try:
                result: object = ctx.run(fn, arg)
                error: BaseException | None = None
            except BaseException as e:  # the handler's, handed to the loop
                result, error = None, e
            # Idle before the loop hears of it: the next submit() the result prompts then reuses
            # this thread instead of starting another.
            with self._lock:
                self._idle += 1
            _hand_over(loop, fut, result, error)
            del work, ctx, fn, arg, fut, loop, result, error


def _hand_over(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[object], result: object,
               error: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if isinstance(error, StopIteration):  # a future refuses to hold one
            fut.set_exception(RuntimeError(f"handler raised StopIteration: {error}"))
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: the worker is gone, nobody waits for this body
