"""`TrainContext`: where a worker stands, as the loop sees it (Ray Train's `get_context()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.protocol import Assignment


@dataclass(frozen=True)
class RunInfo:
    """What the driver knows of the run that every worker's context tells the loop."""

    name: str
    trial_name: str | None = None  # the Ray Tune trial this run belongs to, if any
    trial_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # TorchTrainer(metadata=...)


@dataclass
class TrainContext:
    """Where this worker stands (Ray Train's `get_context()`)."""

    assignment: Assignment
    run: RunInfo
    storage: RunStorage

    def get_world_rank(self) -> int:
        return self.assignment.rank

    def get_world_size(self) -> int:
        return self.assignment.world_size

    def get_local_rank(self) -> int:
        return self.assignment.local_rank

    def get_local_world_size(self) -> int:
        return self.assignment.local_world_size

    def get_node_rank(self) -> int:
        return self.assignment.node_rank

    def get_generation(self) -> int:
        """The membership generation: it grows by one at every change of the worker set."""
        return self.assignment.generation

    def get_experiment_name(self) -> str:
        return self.run.name

    def get_trial_dir(self) -> str:
        return self.storage.url()
