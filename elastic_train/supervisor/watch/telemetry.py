"""The supervisor's events and news: every event is stamped once and handed to each observer (the
event log, the exported metrics); callers that wait for news (the driver's feed, a SYNC report
waiting for its commit, members leaving a failed run) wake whenever an event is recorded or a
report settles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from elastic_train.events import Event, EventObserver


class Telemetry:
    def __init__(self, observers: Sequence[EventObserver], started: float):
        """`started`: the run's start, in monotonic time (events carry their time since it)."""
        self._observers = list(observers)
        self._started = started
        self._news = asyncio.Event()

    def record(self, event: Event) -> None:
        now = time.monotonic()
        entry = event.entry(round(now - self._started, 4), time.time())
        for observer in self._observers:
            observer.on_event(event, entry, now)
        self._news.set()

    def news(self) -> None:
        """Something a waiter may be waiting for happened (a report settled, a worker parked)."""
        self._news.set()

    async def until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `condition()` holds (checked at every piece of news); False if `timeout_s`
        passed first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._news.clear()
            try:
                await asyncio.wait_for(self._news.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return True
