"""Preemption notices, as the loop sees them: what `get_preemption_info()` answers, and the budget
of preemptions the run survives (`FailureConfig.max_preemption_failures`).

Why a barrier (agreement.py): every rank must get the same answer at the same step, or rank 0 would
save a just-in-time checkpoint at a step where its peers did not report one.

Notices come from the workers (SIGTERM, cloud metadata pollers) and from Ray itself (a node that
Ray drains: `ray drain-node`, KubeRay, the autoscaler), which the supervisor polls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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


class Notices:
    def __init__(self, max_preemptions: int):
        self._max = max_preemptions
        self.count = 0  # generations ended by a preemption
        self.deadlines: dict[int, int | None] = {}  # worker id -> the deadline its notice gave
        self.asked_in: set[int] = set()  # generations whose loop calls get_preemption_info()

    def noted(self, worker_id: int, seconds_left: float | None) -> None:
        self.deadlines[worker_id] = deadline_ms(seconds_left)

    def preempted(self) -> bool:
        """A generation ends for a preemption; True once that spends the budget."""
        self.count += 1
        return self._max != -1 and self.count > self._max
