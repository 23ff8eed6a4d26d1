"""The supervisor's background coroutines that the run's end waits for (commits, probes, hand-overs,
watching a worker until it ends)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Future] = set()

    def track(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future:
        """Run `coroutine` as a task that `wait` waits for."""
        task = asyncio.ensure_future(coroutine)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def wait(self, deadline: float) -> None:
        """Until every task (and each one they started) is done, or monotonic time `deadline`."""
        while self._running and time.monotonic() < deadline:
            await asyncio.wait(set(self._running), timeout=deadline - time.monotonic())

    @staticmethod
    def every(interval_s: float, work: Callable[[], Awaitable[Any]], go_on: Callable[[], bool]) -> asyncio.Future:
        """Await `work()` every `interval_s` while `go_on()`; not tracked (`wait` does not wait for its sleep)."""
        async def loop() -> None:
            while go_on():
                await work()
                await asyncio.sleep(interval_s)
        return asyncio.ensure_future(loop())
