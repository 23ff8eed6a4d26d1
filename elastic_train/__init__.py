"""elastic_train: fault tolerance and elastic scaling for distributed PyTorch training on Ray.

The API mirrors Ray Train's, so code written for `ray.train` runs after changing its imports.

Its names are imported when first used (PEP 562): the supervisor's process, which never trains,
starts without importing torch (a second of every run's start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_train.unsupported import lazy_getattr, refuse_unsupported_modules, unsupported_getattr

if TYPE_CHECKING:
    from elastic_train import torch
    from elastic_train.api import (ReportedCheckpoint, get_all_reported_checkpoints, get_checkpoint, get_context,
                                   get_dataset_shard, get_preemption_info, report)
    from elastic_train.backend import BackendConfig
    from elastic_train.callbacks import TrainRunContext, UserCallback
    from elastic_train.checkpoint import Checkpoint
    from elastic_train.checkpoint.modes import CheckpointConsistencyMode, CheckpointUploadMode, ReportedCheckpointStatus
    from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, RunConfig, ScalingConfig
    from elastic_train.errors import (CheckpointError, ConfigError, ControllerError, NCCLHangError, PreemptionError,
                                      StorageError, TrainingFailedError, WorkerGroupError)
    from elastic_train.ingest.config import TRAIN_DATASET_KEY, DataConfig
    from elastic_train.protocol import PreemptionInfo
    from elastic_train.result import Result
    from elastic_train.trainer import DataParallelTrainer, TorchTrainer
    from elastic_train.unsupported import (LoggingConfig, SyncConfig, UnsupportedAPIError, ValidationConfig,
                                           ValidationFn, ValidationTaskConfig)
    from elastic_train.worker.loop.context import TrainContext

_WHERE = {  # name -> the module that defines it
    **dict.fromkeys(["ReportedCheckpoint", "get_all_reported_checkpoints", "get_checkpoint", "get_context",
                     "get_dataset_shard", "get_preemption_info", "report"], "elastic_train.api"),
    **dict.fromkeys(["DataConfig", "TRAIN_DATASET_KEY"], "elastic_train.ingest.config"),
    **dict.fromkeys(["CheckpointConsistencyMode", "CheckpointUploadMode", "ReportedCheckpointStatus"],
                    "elastic_train.checkpoint.modes"),
    "PreemptionInfo": "elastic_train.protocol",
    "Checkpoint": "elastic_train.checkpoint",
    **dict.fromkeys(["CheckpointConfig", "ElasticConfig", "FailureConfig", "RunConfig", "ScalingConfig"],
                    "elastic_train.config"),
    **dict.fromkeys(["TrainRunContext", "UserCallback"], "elastic_train.callbacks"),
    **dict.fromkeys(["CheckpointError", "ConfigError", "ControllerError", "NCCLHangError", "PreemptionError",
                     "StorageError", "TrainingFailedError", "WorkerGroupError"], "elastic_train.errors"),
    "Result": "elastic_train.result",
    "BackendConfig": "elastic_train.backend",
    **dict.fromkeys(["DataParallelTrainer", "TorchTrainer"], "elastic_train.trainer"),
    "TrainContext": "elastic_train.worker.loop.context",
    **dict.fromkeys(["UnsupportedAPIError", "SyncConfig", "LoggingConfig", "ValidationConfig", "ValidationFn",
                     "ValidationTaskConfig"], "elastic_train.unsupported"),
    "torch": "elastic_train.torch",
}


# A public name, imported on first use; `elastic_train.torch` as `ray.train.torch`; a Ray Train name
# elastic_train does not provide is imported, and says what to use instead when built (unsupported.py).
__getattr__ = lazy_getattr(globals(), _WHERE, unsupported_getattr("elastic_train", "ray.train", {}))
refuse_unsupported_modules()  # `from elastic_train.tensorflow import ...` too


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "DataParallelTrainer",
    "TorchTrainer",
    "BackendConfig",
    "ScalingConfig",
    "RunConfig",
    "FailureConfig",
    "CheckpointConfig",
    "ElasticConfig",
    "Checkpoint",
    "Result",
    "report",
    "get_checkpoint",
    "get_context",
    "get_preemption_info",
    "get_all_reported_checkpoints",
    "get_dataset_shard",
    "DataConfig",
    "TRAIN_DATASET_KEY",
    "CheckpointUploadMode",
    "CheckpointConsistencyMode",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "PreemptionInfo",
    "TrainContext",
    "UnsupportedAPIError",
    "ConfigError",
    "CheckpointError",
    "StorageError",
    "TrainingFailedError",
    "WorkerGroupError",
    "ControllerError",
    "PreemptionError",
    "UserCallback",
    "TrainRunContext",
]
