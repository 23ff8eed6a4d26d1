"""Preemption notices, as the loop sees them: what `get_preemption_info()` answers, and the budget
of preemptions the run survives (`FailureConfig.max_preemption_failures`).

Why a barrier: every rank must get the same answer at the same step, or rank 0 would save a
just-in-time checkpoint at a step where its peers did not report one. The first rank to ask waits
for the others; the answer is decided once, when the last one asks.

Notices come from the workers (SIGTERM, cloud metadata pollers) and from Ray itself (a node that
Ray drains: `ray drain-node`, KubeRay, the autoscaler), which the supervisor polls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from elastic_train.protocol import PreemptionInfo


@dataclass(frozen=True)
class Leaving:
    """A member of the current generation under a notice."""

    rank: int
    node_id: str
    deadline_ms: int | None


def preemption_info(leaving: list[Leaving]) -> PreemptionInfo | None:
    """What `get_preemption_info()` answers, given the members under a notice (None if none is)."""
    if not leaving:
        return None
    nodes: dict[str, list[int]] = {}
    for member in leaving:
        nodes.setdefault(member.node_id, []).append(member.rank)
    deadlines = [m.deadline_ms for m in leaving if m.deadline_ms]
    return PreemptionInfo(min(deadlines, default=None), {node: sorted(ranks) for node, ranks in nodes.items()})


def deadline_ms(seconds_left: float | None) -> int | None:
    return None if seconds_left is None else int((time.time() + seconds_left) * 1000)


@dataclass
class _Call:
    arrived: set[int] = field(default_factory=set)  # ranks that asked
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    info: PreemptionInfo | None = None


class Notices:
    def __init__(self, max_preemptions: int):
        self._max = max_preemptions
        self.count = 0  # generations ended by a preemption
        self.deadlines: dict[int, int | None] = {}  # worker id -> the deadline its notice gave
        self._calls: dict[tuple[int, int], _Call] = {}  # (generation, call number) -> its barrier
        self.asked_in: set[int] = set()  # generations whose loop calls get_preemption_info()

    def noted(self, worker_id: int, seconds_left: float | None) -> None:
        self.deadlines[worker_id] = deadline_ms(seconds_left)

    def preempted(self) -> bool:
        """A generation ends for a preemption; True once that spends the budget."""
        self.count += 1
        return self._max != -1 and self.count > self._max

    async def agree(self, generation: int, call: int, rank: int, world_size: int,
                    leaving: Callable[[], list[Leaving]], timeout_s: float) -> PreemptionInfo | None:
        """Call number `call` of `get_preemption_info()` by `rank`: returns, once every rank made it,
        the answer decided when the last one did (`leaving()` then). Raises if the other ranks do
        not make it within `timeout_s`: a loop that asks on some ranks only would hang."""
        self.asked_in.add(generation)
        barrier = self._calls.setdefault((generation, call), _Call())
        barrier.arrived.add(rank)
        if len(barrier.arrived) >= world_size:
            barrier.info = preemption_info(leaving())
            del self._calls[(generation, call)]
            barrier.answered.set()
            return barrier.info
        try:
            await asyncio.wait_for(barrier.answered.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"get_preemption_info() call {call} waited preemption_info_timeout_s={timeout_s}s for ranks "
                f"{sorted(set(range(world_size)) - barrier.arrived)}: every rank must call it the same number of "
                "times (it is a barrier, as in Ray Train).") from None
        return barrier.info

    def release(self) -> None:
        """The generation ended: calls waiting for their peers are answered (the loop unwinds)."""
        for barrier in self._calls.values():
            barrier.answered.set()
        self._calls.clear()
