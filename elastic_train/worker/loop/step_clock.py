"""The loop's step time: its time between reports, outside report() and the other barriers.

Sent with each report (`Pace`) for the supervisor to tell stragglers by (supervisor/watch/pace.py): a
rank that waits at a barrier for a slow peer must not look slow itself.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from elastic_train.protocol import Pace
from elastic_train.worker.resident import resident_bytes


class StepClock:
    def __init__(self) -> None:
        self._step_s = 0.0  # the loop's time since the last report, outside report() and other barriers
        self._outside_since = time.monotonic()
        self._stall_s = 0.0  # how long the last report() held the loop

    def _elapsed(self) -> float:
        return self._step_s + time.monotonic() - self._outside_since

    @contextmanager
    def in_report(self) -> Iterator[Pace]:
        """Within report(): yields the pace of the step that ends there; the next step starts as it returns."""
        pace = Pace(self._elapsed(), resident_bytes(), self._stall_s)
        self._step_s = 0.0
        entered = time.monotonic()
        try:
            yield pace
        finally:
            self._outside_since = time.monotonic()
            self._stall_s = self._outside_since - entered

    @contextmanager
    def in_barrier(self) -> Iterator[None]:
        """Within another barrier (get_preemption_info, collective): not counted in the step."""
        self._step_s = self._elapsed()
        try:
            yield
        finally:
            self._outside_since = time.monotonic()
