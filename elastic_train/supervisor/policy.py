"""Pure decisions of the supervisor: what an event means, given the run's state. No Ray, no I/O:
the actor gathers the facts, calls these, and carries out what they return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """A running member's last report in the current generation."""

    worker_id: int
    index: int  # its last report index (the resume index until its first report)
    since: float  # when it made that report (or joined the generation)


@dataclass(frozen=True)
class Stall:
    """What to do about a generation in which no member reported for `progress_timeout_s`."""

    hung: tuple[int, ...] = ()  # members behind the others: hung; dropped and replaced
    restart: bool = False  # all stand at the same report: abort them all; whoever does not leave is hung


def stalled(progress: list[Progress], now: float, timeout_s: float | None) -> Stall:
    """A member whose heartbeat thread is alive but whose loop is stuck (a deadlock, a hung kernel, a
    hung read) stops reporting. `report()` is a barrier, so the others soon stop too: the generation
    stalls. The hung members are those behind: the lowest last report index. When all stand at the
    same index (every rank stuck in one collective with the hung one), nobody can be told apart: the
    generation is aborted, and a member that does not leave within `drain_timeout_s` is dropped."""
    if timeout_s is None or not progress or now - max(p.since for p in progress) <= timeout_s:
        return Stall()
    lowest = min(p.index for p in progress)
    behind = tuple(sorted(p.worker_id for p in progress if p.index == lowest))
    if len(behind) == len(progress):
        return Stall(restart=True)
    return Stall(hung=behind)

