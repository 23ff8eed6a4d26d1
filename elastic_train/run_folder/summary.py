"""What a run ends with: the supervisor's account of it, which `fit()` turns into a `Result`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.protocol import PreemptionInfo, RunState


@dataclass
class RunSummary:
    """What `fit()` turns into a `Result`."""

    state: RunState
    error: str | None
    metrics: dict[str, Any]
    metrics_history: list[dict[str, Any]]
    checkpoints: list[CommittedCheckpoint]
    events: list[dict[str, Any]] = field(default_factory=list)
    worker_failures: dict[int, BaseException] = field(default_factory=dict)
    """World rank -> what the user's code raised there, in the failure that ended the run."""
    preemption: PreemptionInfo | None = None
    """The preemption that spent FailureConfig.max_preemption_failures, if that ended the run."""
    stopped: str | None = None
    """Why `stop_run` ended the run, if it did."""
    returned: bytes | None = None
    """What rank 0's loop returned, pickled (`Result.return_value`), if the run finished."""
