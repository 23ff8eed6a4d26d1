"""`TrainWorker`: the Ray actor of a worker; what it does is member.py's `Member`.

Endpoints only, called by the supervisor and by peers. The supervisor creates workers from this
class, so this module imports nothing of the worker's machinery (torch, the process group, the
loop's session): the member is imported in the worker's own process, as Ray builds the actor there.
Importing it in the supervisor would add torch's ~1.3 s to the start of every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic_train.protocol import HeldCheckpoint, WorkerInfo
from elastic_train.run_spec import WorkerSpec

if TYPE_CHECKING:
    from elastic_train.worker.member import Member


class TrainWorker:
    def __init__(self, worker_id: int, supervisor: Any, spec: WorkerSpec):
        from elastic_train.worker.member import Member  # in the worker's process only: see the module's docstring

        self._member: Member = Member(worker_id, supervisor, spec)

    def ping(self) -> int:
        return self._member.ping()

    def end_generation(self, generation: int) -> None:
        """The supervisor ends `generation`: fail its collectives so the loop unwinds."""
        self._member.end_generation(generation)

    def unwind_at(self, generation: int, index: int, grow: bool = False) -> None:
        """The supervisor re-forms the group: leave `generation`'s group at the first report numbered
        `index` or later (`grow`: at the first such report that carries a checkpoint)."""
        self._member.unwind_at(generation, index, grow)

    def read_checkpoint(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Files of checkpoint `index` of `generation`, from this worker's own part or a peer's replica."""
        return self._member.read_checkpoint(generation, index, names)

    def hold_replica(self, held: HeldCheckpoint, files: dict[str, bytes] | None, *pieces: tuple[str, bytes]) -> None:
        """Keep a peer's checkpoint part."""
        self._member.hold_replica(held, files, *pieces)

    def hand_over(self, generation: int, index: int, names: list[str], peer: Any) -> None:
        """This worker is leaving: copy its files of a checkpoint into `peer`'s memory."""
        self._member.hand_over(generation, index, names, peer)

    def describe(self) -> WorkerInfo:
        """Where this worker stands, for a restarted supervisor to adopt it."""
        return self._member.describe()

    def wait_stopped(self) -> None:
        """Returns when this worker's run has ended."""
        self._member.wait_stopped()

    def run(self) -> str:
        """Run the loop, generation after generation, until a `Stop`: its reason."""
        return self._member.run()
