"""elastic_train: fault tolerance and elastic scaling for distributed PyTorch training on Ray.

The API mirrors Ray Train's, so code written for `ray.train` runs after changing its imports.
"""

from elastic_train.api import (ReportedCheckpoint, get_all_reported_checkpoints, get_checkpoint, get_context,
                               get_preemption_info, report)
from elastic_train.checkpoint.modes import CheckpointConsistencyMode, CheckpointUploadMode, ReportedCheckpointStatus
from elastic_train.protocol import PreemptionInfo
from elastic_train.checkpoint import Checkpoint
from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, RunConfig, ScalingConfig
from elastic_train.callbacks import TrainRunContext, UserCallback
from elastic_train.errors import (CheckpointError, ConfigError, ControllerError, PreemptionError, StorageError,
                                  TrainingFailedError, WorkerGroupError)
from elastic_train.result import Result
from elastic_train.backend import BackendConfig
from elastic_train.trainer import DataParallelTrainer, TorchTrainer
from elastic_train.worker.context import TrainContext
from elastic_train.unsupported import UnsupportedAPIError
# Ray Train names that elastic_train does not provide fail with what to use instead (unsupported.py).
from elastic_train.unsupported import ray_train_getattr as __getattr__  # noqa: F401
from elastic_train import torch  # noqa: E402,F401 - `elastic_train.torch.prepare_model`, as `ray.train.torch`

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
