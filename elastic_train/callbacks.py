"""`UserCallback`: hooks that run in the driver process while `fit()` runs (Ray Train's
`ray.train.UserCallback`, with two hooks of our own: `after_resize` and `on_run_end`).

Why in the driver: a callback holds whatever the user's script holds (a Tune session, a tracker's
client, a progress bar) and needs none of it pickled. The supervisor keeps the reports and events;
`fit()` long-polls it (`Supervisor.feed`) and calls the hooks in order, one at a time, from the
thread that called `fit()`.

Errors, as in Ray Train: an `Exception` raised by a hook fails the run. It is logged, the run is
stopped cleanly (its last checkpoint committed), and `fit()` raises `ControllerError` with the
hook's exception as `controller_failure`. A `BaseException` that is not an `Exception`
(`SystemExit`, which Tune raises from a stopped trial's report; `KeyboardInterrupt`) also stops the
run cleanly and then propagates unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elastic_train.errors import ControllerError

if TYPE_CHECKING:
    from elastic_train.checkpoint import Checkpoint
    from elastic_train.config import RunConfig, ScalingConfig
    from elastic_train.result import Result
    from elastic_train.torch.config import TorchConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRunContext:
    """What a callback knows of the run it is called for (Ray Train's `TrainRunContext`)."""

    run_id: str  # unique to this fit() (a new fit() with the same name is a new run id)
    name: str  # RunConfig.name: the run's folder under the storage path
    path: str  # the run's folder in storage (Result.path)
    run_config: RunConfig
    train_loop_config: dict[str, Any] | None
    scaling_config: ScalingConfig
    torch_config: TorchConfig
    metadata: dict[str, Any] = field(default_factory=dict)
    trial_name: str | None = None  # the Ray Tune trial that runs this fit(), if any
    trial_id: str | None = None

    def get_run_config(self) -> RunConfig:
        return self.run_config


class UserCallback:
    """Subclass it and override the hooks you need; pass instances in `RunConfig(callbacks=[...])`.

    Hooks run in the driver process, in the thread that called `fit()`, in the order the callbacks
    are listed. While a hook runs, training goes on; the next reports wait for it in the
    supervisor. See the module docstring for what a hook that raises does.
    """

    # What `RunConfig` checks its callbacks for: the config package, below every other module, imports none.
    is_elastic_train_callback = True

    def after_report(self, run_context: TrainRunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        """Every rank made a report: `metrics[rank]` is what rank `rank` reported. `checkpoint` is
        the checkpoint committed to storage for this report, or None when the report had none or
        it was not stored (a store cadence skipped it, or its upload was given up). Called in
        report order; a report whose checkpoint is on its way waits until it is committed."""

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, BaseException]) -> None:
        """The user's code raised on some ranks (one failure, counted against
        `FailureConfig.max_failures`): `worker_exceptions[rank]` is the exception, with the
        worker's traceback in its `__notes__`. Called for every such failure, also those the run
        survives (as Ray Train does)."""

    def after_resize(self, run_context: TrainRunContext, old_world_size: int, new_world_size: int) -> None:
        """A new generation formed at another world size: workers were lost or left (shrink), or
        capacity came back (grow). Not called for a restart at the same size. Ray Train has no
        such hook (its groups restart rather than resize)."""

    def on_run_end(self, run_context: TrainRunContext, result: Result) -> None:
        """The run ended and its workers are gone; its record's final write follows (it records
        what this hook decides). `result.error` is the `TrainingFailedError` that `fit()` raises
        next (None when the run finished or was stopped). An exception raised here fails a finished
        run with `ControllerError`; it is logged and ignored when the run already failed, whose
        error is kept. Not called when the supervisor itself died (`fit()` raises `ControllerError`)."""


class CallbackRunner:
    """Calls a hook of every callback in order; an `Exception` becomes a `ControllerError`."""

    def __init__(self, callbacks: list[UserCallback], context: TrainRunContext):
        self.callbacks = callbacks
        self.context = context

    def __call__(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(self.context, *args)
            except Exception as exc:  # noqa: BLE001 - the run fails with it, as in Ray Train
                logger.exception("callback %s raised in %s; the run is stopped", type(callback).__name__, hook)
                raise ControllerError(exc) from exc


__all__ = ["UserCallback", "TrainRunContext", "CallbackRunner"]
