"""Ray V2's `ray.train.v2.api.report_config`: how `report()` stores a checkpoint, and which reported
checkpoints `get_all_reported_checkpoints()` answers (checkpoint/modes.py)."""

from elastic_train.checkpoint.modes import CheckpointConsistencyMode, CheckpointUploadMode

__all__ = ["CheckpointUploadMode", "CheckpointConsistencyMode"]
