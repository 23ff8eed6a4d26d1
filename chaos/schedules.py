"""When faults fire: at given times, every T seconds, on a seeded Poisson process, or as a spot
trace says. A schedule is a finite, reproducible list of offsets (seconds from the start), so a
run's fault timeline can be planned, printed and compared before anything is injected."""

from __future__ import annotations

import random
from dataclasses import dataclass

from chaos.traces import TraceEvent


@dataclass(frozen=True)
class Firing:
    """One scheduled fault: `at_s` seconds after the start; `action` is "fault" for plain
    schedules, "add"/"remove" for node events of a replayed trace."""

    at_s: float
    action: str = "fault"
    node: str | None = None


def at(times_s: list[float]) -> list[Firing]:
    return [Firing(float(t)) for t in sorted(times_s)]


def every(interval_s: float, count: int, start_s: float | None = None) -> list[Firing]:
    """`count` faults, `interval_s` apart, the first at `start_s` (default: one interval in)."""
    first = interval_s if start_s is None else start_s
    return [Firing(first + i * interval_s) for i in range(count)]


def poisson(mean_interval_s: float, count: int, seed: int = 0, start_s: float = 0.0) -> list[Firing]:
    """`count` faults with exponential gaps of mean `mean_interval_s`, from a seeded generator."""
    rng = random.Random(seed)
    t, out = start_s, []
    for _ in range(count):
        t += rng.expovariate(1.0 / mean_interval_s)
        out.append(Firing(round(t, 3)))
    return out


def replay(events: list[TraceEvent]) -> list[Firing]:
    """A (compressed, capped) trace's node events as firings."""
    return [Firing(e.at_s, e.action, e.node) for e in events]
