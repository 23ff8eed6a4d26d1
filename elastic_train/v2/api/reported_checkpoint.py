"""Ray V2's `ray.train.v2.api.reported_checkpoint`: what `get_all_reported_checkpoints()` answers."""

from elastic_train.api import ReportedCheckpoint
from elastic_train.checkpoint.modes import ReportedCheckpointStatus

__all__ = ["ReportedCheckpoint", "ReportedCheckpointStatus"]
