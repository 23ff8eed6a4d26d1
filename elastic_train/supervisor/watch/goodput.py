"""Where the run's time went: the steps that count, the steps redone, each recovery, goodput so far.

Pure bookkeeping of (state, event), no Ray: the supervisor feeds it the events it records and the
reports every member made; `watch/metrics.py` exports what it holds. Goodput is what the benchmarks call
it: the loop time of the steps that count (each report's latest making, its members' median step
time) over the wall time since the first generation opened.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable


class GoodputAccount:
    def __init__(self, rate_window: int = 20):
        self.started: float | None = None  # when the first generation (of this supervisor) opened
        self.generation = -1
        self.kept: dict[int, float] = {}  # report index -> its step time, for the reports that count
        self.steps_redone = 0
        self.fault_at: float | None = None  # a member was lost and no report was made since
        self._made: deque[float] = deque(maxlen=rate_window)  # times of this generation's latest reports

    def opened(self, generation: int, resume_index: int, now: float) -> int:
        """Generation `generation` opened, resuming after report `resume_index`: the reports made
        beyond it will be made again and no longer count. Returns how many."""
        if self.started is None:
            self.started = now
        self.generation = generation
        redone = sum(i > resume_index for i in self.kept)
        self.kept = {i: s for i, s in self.kept.items() if i <= resume_index}
        self.steps_redone += redone
        self._made.clear()
        return redone

    def lost(self, generation: int, rank: int, now: float) -> None:
        """A worker left the run: a fault if it was a member of the current generation (a standby's
        loss costs no step)."""
        if generation == self.generation and rank >= 0:
            self.fault(now)

    def fault(self, now: float) -> None:
        """The run's generation failed: recovery is timed from the first fault until a report is made."""
        if self.fault_at is None:
            self.fault_at = now

    def made(self, index: int, step_times: Iterable[float], now: float) -> float | None:
        """Every member made report `index`; returns the recovery time (fault -> this report) if it
        is the first report since a fault."""
        times = list(step_times)
        self.kept[index] = statistics.median(times) if times else 0.0
        self._made.append(now)
        recovered = None if self.fault_at is None else now - self.fault_at
        self.fault_at = None
        return recovered

    def steps_per_s(self) -> float:
        """Reports made per second over the last ones of the current generation."""
        if len(self._made) < 2 or self._made[-1] <= self._made[0]:
            return 0.0
        return (len(self._made) - 1) / (self._made[-1] - self._made[0])

    def goodput(self, now: float) -> float:
        """The loop time of the steps that count over the wall time since the first generation opened."""
        if self.started is None or now <= self.started:
            return 0.0
        return min(1.0, sum(self.kept.values()) / (now - self.started))
