"""The run's states and the transitions allowed between them.

    SCHEDULING --(>= min workers ready)--------------------------------> RUNNING
    RUNNING ----(capacity for more workers: unwind at the next report)-> RESIZING
    RUNNING/RESIZING --(a member lost, a collective or user code failed)-> RESTARTING
    RESIZING/RESTARTING --(every survivor parked)--> RUNNING (next generation), or SCHEDULING (< min)
    ADOPTING (a restarted supervisor) --(workers found)--> RUNNING (their generation goes on),
        RESTARTING (ranks of it are missing), or SCHEDULING (no generation yet)
    any ---> FINISHED (the loop returned, or a stop was asked) | ERRORED (failures over budget, no capacity)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from elastic_train.protocol import RunState

if TYPE_CHECKING:
    from elastic_train.supervisor.membership import WorkerRecord


_ALLOWED = {
    RunState.ADOPTING: {RunState.RUNNING, RunState.SCHEDULING, RunState.ERRORED},
    RunState.SCHEDULING: {RunState.RUNNING, RunState.FINISHED, RunState.ERRORED},
    RunState.RUNNING: {RunState.RESIZING, RunState.RESTARTING, RunState.FINISHED, RunState.ERRORED},
    RunState.RESIZING: {RunState.RUNNING, RunState.RESTARTING, RunState.SCHEDULING, RunState.FINISHED,
                        RunState.ERRORED},
    RunState.RESTARTING: {RunState.RUNNING, RunState.SCHEDULING, RunState.FINISHED, RunState.ERRORED},
    RunState.FINISHED: set(),
    RunState.ERRORED: set(),
}


def check_transition(current: RunState, target: RunState) -> None:
    if target not in _ALLOWED[current]:
        raise AssertionError(f"illegal run-state transition {current.value} -> {target.value}")


class RunView(Protocol):
    """What the supervisor's parts read of the run; the controller alone changes it."""

    @property
    def state(self) -> RunState: ...

    @property
    def generation(self) -> int:
        """The current generation's number (-1 before the first)."""

    @property
    def world_size(self) -> int: ...

    @property
    def flush_chosen(self) -> bool:
        """The run ended and what its workers store as they stop is decided: no report counts after."""

    def is_member(self, w: WorkerRecord) -> bool:
        """Is `w` a member of the current generation?"""

    def members(self) -> list[WorkerRecord]:
        """The current generation's members (in their loop, or parked out of it)."""
