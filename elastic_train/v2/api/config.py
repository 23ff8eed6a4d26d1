"""`ray.train.v2.api.config`."""

from elastic_train.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig"]
