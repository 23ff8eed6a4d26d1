"""What a generation's session gets from the worker that runs it: plain facts (`SessionSetup`) and
the worker's services (`WorkerServices`, implemented in worker/member.py).

Why: the session (the user's API inside the loop) holds, stores and reports through the worker's
memory, store queue and report sender, which outlive the generation; naming them in one Protocol keeps
the session free of the worker's internals and says in one place what it relies on.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from elastic_train.config import CheckpointConfig
from elastic_train.protocol import Assignment, HeldCheckpoint, PlaceRead, Position, Report
from elastic_train.run_spec import LoopSpec
from elastic_train.worker.hold.parts import Part
from elastic_train.worker.loop.context import TrainContext
from elastic_train.worker.store.queue import PartToStore


@dataclass(frozen=True)
class SessionSetup:
    """The facts a session starts from."""

    worker_id: int
    context: TrainContext  # the generation's place, the run, its storage
    checkpointing: CheckpointConfig  # which reported checkpoints are stored (a rank decides for its live parts)
    settle_timeout_s: float  # how long SYNC / NO_UPLOAD reports wait for their commit
    loop: LoopSpec  # the checkpoint it starts from (resume_from_checkpoint), its datasets and their DataContext
    recover_in_place: bool = False  # ElasticConfig.recover_in_place
    backend: str = "gloo"  # the run's process groups' (in place is gloo's)
    sharded_state_budget: float = 0.05  # ElasticConfig.sharded_state_budget
    part_safe_wait_s: float = 0.05  # ElasticConfig.part_safe_wait_s


class WorkerServices(Protocol):
    """The worker's services to its generation's session."""

    supervisor: Any  # the supervisor's actor handle: the session asks it what every rank must know alike

    def hold(self, held: HeldCheckpoint, part: Part, replicate: bool,
             facts: Future[dict[str, dict[str, Any]]] | None, safe: threading.Event | None = None) -> None:
        """Hold a reported part in memory; with `replicate`, copy its files to the buddy (`facts`: on
        their way), unless `safe` (set once the part is stored) is set first; set it once copied."""

    def hold_replica(self, held: HeldCheckpoint, files: dict[str, bytes]) -> None:
        """Keep a copy of a peer's part, received at a report's barrier (worker/report/part_exchange.py)."""

    def replication_s(self) -> float | None:
        """How long the last copy of a part to the buddy took; None while one is on its way."""

    def share_delivered(self) -> bool:
        """Has this worker's newest share of a sharded model reached its buddy?"""

    def replicated(self, generation: int) -> None:
        """Every rank's newest share of a sharded model reached its buddy: older share replicas may go."""

    def read_held(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Files of a checkpoint this worker holds (its own part or a peer's replica); KeyError if not held."""

    def held_state(self, generation: int, index: int) -> dict[str, Any] | None:
        """The kept state of that report, if this worker holds it as live tensors."""

    def store(self, part: PartToStore) -> float | None:
        """Hand a part to the store queue: the seconds it waited for room, None if the generation ended meanwhile."""

    def send_report(self, report: Report, urgent: bool) -> None:
        """Send a report that needs no reply, in the background (`urgent`: a peer's round trip waits for it)."""

    def flush_reports(self, timeout_s: float) -> bool:
        """Wait until the reports sent so far are recorded; False if not within `timeout_s`."""

    def generation_ended(self) -> bool:
        """Has the supervisor ended this generation?"""

    def unwind_due(self, index: int) -> bool:
        """Was this worker asked to leave the group at report `index`?"""

    def grow_due(self, index: int) -> bool:
        """... or at report `index` if it carries a checkpoint (newcomers join; worker/report/plan.py `leaves`)?"""

    def unwind_at(self, index: int) -> None:
        """Leave the loop at report `index` (or the first after)."""

    def reform(self, position: Position, reads: tuple[PlaceRead, ...]) -> Assignment | None:
        """A collective of the loop's step failed: park at the supervisor from inside the loop, which
        stands at `position`. Returns the next generation's place, its group joined, when the loop goes
        on in place; None when it must unwind (the worker then runs the place it was given). `reads`:
        what the loop holds of its place, which the next generation's places must not change."""
