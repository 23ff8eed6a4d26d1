"""User-facing configuration, with Ray Train's names and an `ElasticConfig` for our own knobs.

Every config validates itself on construction, so bad input fails in the driver, before any actor
starts, with a message that names the problem and the fix. The package imports nothing of the
project but its errors: every other module may import it.

    scaling.py   ScalingConfig: how many workers, and what each one asks for
    run.py       RunConfig, FailureConfig, CheckpointConfig: where results go, failures, checkpoints
    elastic.py   ElasticConfig: the elastic runtime's timeouts and intervals
    ray_only.py  Ray Train's fields we do not have, refused with what to use instead
"""

from elastic_train.config.elastic import ElasticConfig
from elastic_train.config.run import CheckpointConfig, FailureConfig, RunConfig
from elastic_train.config.scaling import ScalingConfig

__all__ = [
    "ScalingConfig",
    "FailureConfig",
    "CheckpointConfig",
    "ElasticConfig",
    "RunConfig",
]
