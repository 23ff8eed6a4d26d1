"""`ray.train.v2.api.exceptions`."""

from elastic_train.errors import ControllerError, PreemptionError, TrainingFailedError, WorkerGroupError

__all__ = ["ControllerError", "PreemptionError", "TrainingFailedError", "WorkerGroupError"]
