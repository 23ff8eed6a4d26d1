"""How `report()` stores a checkpoint (Ray Train's `CheckpointUploadMode`)."""

from __future__ import annotations

import enum


class CheckpointUploadMode(enum.Enum):
    """ASYNC: `report()` returns once the checkpoint is held in memory; it is stored in the
    background (our default: the in-memory copies already protect the state; Ray Train's is SYNC).
    SYNC: `report()` returns once the checkpoint is committed in storage (its manifest written).
    NO_UPLOAD: the loop already wrote the checkpoint into the run's folder (at
    `get_context().get_storage().build_checkpoint_path_from_name(name)`, with
    `torch.distributed.checkpoint` say); it is listed, checksummed and committed with a manifest,
    and `report()` returns once it is."""

    ASYNC = "ASYNC"
    SYNC = "SYNC"
    NO_UPLOAD = "NO_UPLOAD"


class CheckpointConsistencyMode(enum.Enum):
    """What `get_all_reported_checkpoints()` waits for (Ray Train's). elastic_train has no validation
    step, so both wait for the reported checkpoints to be committed."""

    COMMITTED = "COMMITTED"
    VALIDATED = "VALIDATED"


class ReportedCheckpointStatus(enum.Enum):
    """A reported checkpoint's status (Ray Train's names). elastic_train reports COMMITTED only: it
    has no validation step."""

    COMMITTED = "COMMITTED"
    PENDING_VALIDATION = "PENDING_VALIDATION"
    VALIDATED = "VALIDATED"
    VALIDATION_TIMEOUT = "VALIDATION_TIMEOUT"
    VALIDATION_FAILED = "VALIDATION_FAILED"
