"""Exceptions that elastic_train raises to its users."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastic_train.protocol import PreemptionInfo


def qualified(value: object) -> str:
    """The class of `value` with its module, as a message names it: Ray's `ray.air.ScalingConfig` and
    ours share a name."""
    return f"{type(value).__module__}.{type(value).__qualname__}"


class ConfigError(ValueError):
    """A configuration is invalid; the message names the problem and the fix."""


class RayDeprecatedError(ConfigError, DeprecationWarning):
    """A setting Ray Train deprecated. Ray raises a `DeprecationWarning` for it, and so does this (it is
    both), with what to use instead."""


class TrainingFailedError(RuntimeError):
    """The run failed (Ray Train's `ray.train.TrainingFailedError`): `fit()` raises one of its
    subclasses, `WorkerGroupError`, `ControllerError` or `PreemptionError`.

    `str(error)` carries the original traceback from the worker that raised. Pickling keeps the
    subclass, its fields and the notes (`__reduce__`), so an error crosses processes whole (Tune
    sends a trial's error to its driver).
    """

    def __reduce__(self) -> tuple:
        return self.__class__, self._reduce_args(), dict(self.__dict__)

    def _reduce_args(self) -> tuple:
        return self.args


class WorkerGroupError(TrainingFailedError):
    """The user's code raised on workers more often than `FailureConfig.max_failures` allows.

    `worker_failures` maps each world rank that raised (in the failure that ended the run) to its
    exception; the worker's traceback is in the exception's `__notes__`. An exception that could not
    be pickled on its way from the worker arrives as a RuntimeError whose message is the traceback.
    """

    def __init__(self, error_message: str, worker_failures: dict[int, BaseException]):
        super().__init__("Training failed due to worker errors:\n" + error_message)
        self._error_message = error_message
        self.worker_failures = worker_failures

    def _reduce_args(self) -> tuple:
        return self._error_message, self.worker_failures



class NCCLHangError(WorkerGroupError):
    """Ray Train's error for a hung NCCL collective, here so that code catching it runs: it is never
    raised, as a hung collective does not end the run here. It is detected (ElasticConfig.progress_timeout_s,
    collective_timeout_s), and the group is aborted and re-formed in place."""

class ControllerError(TrainingFailedError):
    """The run failed outside the user's code: capacity never came (`min_workers_timeout_s`),
    storage refused a write, the supervisor died for good, or a `UserCallback` raised (as in Ray
    Train, a callback's error fails the run). `controller_failure` is the underlying exception."""

    def __init__(self, controller_failure: BaseException):
        super().__init__("Training failed due to controller error:\n" + str(controller_failure))
        self.controller_failure = controller_failure
        self.with_traceback(controller_failure.__traceback__)

    def _reduce_args(self) -> tuple:
        return (self.controller_failure,)


class PreemptionError(TrainingFailedError):
    """Preemptions spent `FailureConfig.max_preemption_failures`, a budget of their own, apart from
    `max_failures` (which counts real failures). `preemption_info` says which nodes and ranks the
    last notice named. `drain_timed_out` is Ray's field: True when the workers were ended because
    the reclaim deadline passed before they left."""

    def __init__(self, preemption_info: PreemptionInfo, drain_timed_out: bool = False):
        self.preemption_info = preemption_info
        self.drain_timed_out = drain_timed_out
        super().__init__(
            "Training was interrupted by node preemption "
            f"(preempted_ranks={preemption_info.preempted_ranks}, drain_timed_out={drain_timed_out})."
        )

    def _reduce_args(self) -> tuple:
        return self.preemption_info, self.drain_timed_out


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written."""


class StorageError(CheckpointError):
    """Storage refused an operation (denied, missing bucket, bad credentials), or kept failing."""


# -- what unwinds the user's loop inside a worker (never seen by the driver) ------------------
class GenerationEnded(BaseException):
    """Unwinds the user's loop when its generation ends.

    A BaseException, so that the user's `except Exception:` does not swallow it.
    """


class PeerLost(GenerationEnded):
    """`report()`'s barrier failed while the generation still ran: a peer was lost (its connection
    closed) before the supervisor knew. The loop unwinds as from any failed collective."""


class CorruptCopy(PeerLost):
    """A file of the checkpoint this generation resumes from, served from memory, is not what its
    report made: the generation ends, and the next one resumes from another copy."""
