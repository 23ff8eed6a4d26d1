"""Stragglers and growing memory: which workers hold the run back, from what each report tells.

A rank's *step time* is the time its loop spent between two reports, outside `report()` (the
worker measures it). `report()` is a barrier, so a slow rank's peers wait inside it and their step
time stays short: a rank whose step time exceeds `straggler_factor` times the median of its peers'
(and by at least `straggler_min_excess_s`) at `straggler_reports` reports in a row is a straggler.
A rank that is slow before a collective of its step (DDP's all-reduce in `backward()`) makes its
peers wait inside that collective instead: their step times then grow alike, and it is not told
apart. Memory grows when a worker's RSS rose at each of `memory_growth_reports` reports in a row,
by at least `memory_growth_min_mb` in all: a leak, or caches that will end in an OOM kill.

Pure decisions, kept by `PaceWatch` per worker id; the supervisor records and shows them.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence


def peer_medians(step_times: Mapping[int, float]) -> dict[int, float]:
    """Each key's peers' median step time (a key alone has no peers)."""
    return {key: statistics.median(s for k, s in step_times.items() if k != key)
            for key in step_times if len(step_times) > 1}


def slow_ranks(step_times: Mapping[int, float], factor: float, min_excess_s: float) -> set[int]:
    """The keys whose step time exceeds `factor` times the median of the others', and that median by
    at least `min_excess_s` (alone, a key has no peers to be slower than)."""
    return {key for key, median in peer_medians(step_times).items()
            if step_times[key] > factor * median and step_times[key] - median >= min_excess_s}


def climbing(samples: Sequence[float], reports: int, min_growth: float) -> bool:
    """Whether the last `reports` + 1 samples rose each time, by at least `min_growth` in all."""
    if len(samples) < reports + 1:
        return False
    tail = list(samples)[-(reports + 1):]
    return all(later > earlier for earlier, later in zip(tail, tail[1:])) and tail[-1] - tail[0] >= min_growth


@dataclass
class PaceWatch:
    """Streaks of slow reports and recent RSS per worker id, and who is flagged now."""

    factor: float
    reports: int
    min_excess_s: float
    memory_reports: int
    memory_min_growth_bytes: float
    streaks: dict[int, int] = field(default_factory=dict)
    stragglers: set[int] = field(default_factory=set)
    rss: dict[int, deque] = field(default_factory=dict)
    growing: set[int] = field(default_factory=set)
    last_step_s: dict[int, float] = field(default_factory=dict)  # each worker's step time at the last report

    def observe(self, step_times: Mapping[int, float], rss: Mapping[int, float]) -> tuple[set[int], set[int], set[int]]:
        """One report made by every member: their step times and RSS (by worker id; workers absent
        from it are no longer watched). Returns the workers newly flagged stragglers, those that
        caught up, and those newly flagged for growing memory."""
        slow = slow_ranks(step_times, self.factor, self.min_excess_s)
        self.last_step_s = dict(step_times)
        self.streaks = {w: self.streaks.get(w, 0) + 1 if w in slow else 0 for w in step_times}
        flagged = {w for w, streak in self.streaks.items() if streak >= self.reports}
        new, cleared = flagged - self.stragglers, (self.stragglers & set(step_times)) - flagged
        self.stragglers = flagged
        self.rss = {w: self.rss.get(w, deque(maxlen=self.memory_reports + 1)) for w in rss}
        growing = set()
        for worker, value in rss.items():
            self.rss[worker].append(value)
            if climbing(self.rss[worker], self.memory_reports, self.memory_min_growth_bytes):
                growing.add(worker)
        newly_growing, self.growing = growing - self.growing, growing
        return new, cleared, newly_growing
