"""`Result`: what `TorchTrainer.fit()` returns (Ray Train's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_train.checkpoint import Checkpoint
from elastic_train.errors import TrainingFailedError


@dataclass
class Result:
    metrics: dict[str, Any]
    """The last metrics rank 0 reported, with or without a checkpoint."""
    checkpoint: Checkpoint | None
    """The newest committed checkpoint in storage."""
    path: str
    """The run's folder in storage."""
    error: TrainingFailedError | None = None
    """Why the run failed, with the original traceback; None if it finished."""
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    """The kept checkpoints with the metrics reported beside them, oldest first."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The supervisor's timeline: generations, lost workers, fenced writes, state changes."""

    @property
    def metrics_dataframe(self):
        """Every report of rank 0 as a pandas DataFrame, one row per report."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)

    @property
    def world_sizes(self) -> list[int]:
        """The world size of every generation, in order."""
        return [e["world_size"] for e in self.events if e["kind"] == "generation"]
