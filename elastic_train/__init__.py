"""elastic_train: fault tolerance and elastic scaling for distributed PyTorch training on Ray.

The API mirrors Ray Train's, so code written for `ray.train` runs after changing its imports.
"""

from elastic_train.api import get_checkpoint, get_context, report
from elastic_train.checkpoint import Checkpoint
from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, RunConfig, ScalingConfig
from elastic_train.errors import CheckpointError, ConfigError, StorageError, TrainingFailedError
from elastic_train.result import Result
from elastic_train.trainer import TorchTrainer
from elastic_train import torch  # noqa: E402,F401 - `elastic_train.torch.prepare_model`, as `ray.train.torch`

__all__ = [
    "TorchTrainer",
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
    "ConfigError",
    "CheckpointError",
    "StorageError",
    "TrainingFailedError",
]
