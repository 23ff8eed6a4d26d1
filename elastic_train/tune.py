"""Ray Tune over elastic_train: `ray.tune.integration.ray_train` → `elastic_train.tune` (the `tune`
extra). A trainer is a trainable (Ray Train V1's Tuner pattern: each trial fits a copy built from its
config, and ends cleanly when Tune stops it), and `TuneReportCallback` reports a run's metrics to
the trial that runs it (V2's function trainables). How trials are named, resumed, checkpointed and
sized: docs/integrations/tune.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Mapping, Protocol

import ray.tune
from ray.train._internal.session import get_session
from ray.tune.trainable.trainable_fn_utils import _in_tune_session

from elastic_train.callbacks import UserCallback
from elastic_train.checkpoint.checkpoint import Checkpoint, is_local

logger = logging.getLogger(__name__)

CHECKPOINT_PATH_KEY = "checkpoint_path"  # Ray's name for it (ray/tune/integration/ray_train.py)


class Trainable(Protocol):
    """What a trial needs of the trainer it fits (a `DataParallelTrainer`): its arguments by name, a
    copy of it made from them, `fit()` and `stop()`."""

    run_config: Any

    @classmethod
    def argument_names(cls) -> list[str]: ...

    def fit(self) -> Any: ...

    def stop(self, reason: str, timeout_s: float | None = None) -> bool: ...


class TuneReportCallback(UserCallback):
    """Forwards each report of the run to the Tune trial it runs in (Ray's `TuneReportCallback`): rank
    0's metrics, with the checkpoint's folder as "checkpoint_path" when the report carried one."""

    def __init__(self) -> None:
        if not _in_tune_session():
            raise RuntimeError(
                "TuneReportCallback must be used in a Tune session: create it inside the function that "
                "tune.Tuner runs as a trial."
            )
        self._closed = threading.Event()

    def close(self) -> None:
        """Forward nothing more: Tune is ending the trial and takes no more results."""
        self._closed.set()

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        if self._closed.is_set():
            return
        result = dict(metrics[0])
        if checkpoint is not None:
            fs = checkpoint.filesystem
            result[CHECKPOINT_PATH_KEY] = checkpoint.path if is_local(fs) else fs.unstrip_protocol(checkpoint.path)
        # Blocks until Tune asks the trial for its next result: the scheduler sees every report in order.
        ray.tune.report(result)


@dataclasses.dataclass
class _TrialRun:
    trainer: Trainable
    callback: TuneReportCallback


_lock = threading.Lock()
_current: _TrialRun | None = None  # the run of the trial this process hosts: Tune runs one at a time per actor


def run_trial(trainer: Trainable, config: dict[str, Any]) -> None:
    """One Tune trial of `trainer` (`TorchTrainer.__call__`): fits the trainer that the trial's config
    makes of it, reporting to Tune. A failed run raises (`TrainingFailedError`), failing the trial."""
    global _current
    callback = TuneReportCallback()
    trial = trainer_for_trial(trainer, config, ray.tune.get_context().get_trial_id(), callback)
    with _lock:
        _current = _TrialRun(trial, callback)
    try:
        trial.fit()
    finally:
        with _lock:
            _current = None


def trainer_for_trial(
    trainer: Trainable, config: Mapping[str, Any], trial_id: str, callback: UserCallback
) -> Trainable:
    """The trainer a trial fits: `trainer`'s arguments with the trial's config over them (keys that name
    an argument update it, the others go into `train_loop_config`), its run named after the trial and
    followed by `callback` too."""
    parameters = type(trainer).argument_names()
    # The trainer keeps each argument it accepts as an attribute of the same name.
    arguments = {name: getattr(trainer, name) for name in parameters if hasattr(trainer, name)}
    for key, value in config.items():
        if key in parameters:
            arguments[key] = _updated(arguments.get(key), value)
    loop_keys = {key: value for key, value in config.items() if key not in parameters}
    if loop_keys:
        arguments["train_loop_config"] = _updated(arguments.get("train_loop_config") or {}, loop_keys)
    run = arguments["run_config"]
    arguments["run_config"] = dataclasses.replace(
        run, name=f"{run.name or 'TorchTrainer'}_{trial_id}", callbacks=[*(run.callbacks or []), callback]
    )
    return type(trainer)(**arguments)


def _updated(base: Any, value: Any) -> Any:
    """`value` over `base`, as Ray's Tuner merges a trial's config into a trainer's arguments: a dict
    updates a dict key by key and a config (dataclass) field by field, nested ones too; anything else
    replaces."""
    if isinstance(value, Mapping):
        if isinstance(base, Mapping):
            return {**base, **{key: _updated(base.get(key), item) for key, item in value.items()}}
        if dataclasses.is_dataclass(base) and not isinstance(base, type):
            return dataclasses.replace(base, **{key: _updated(getattr(base, key, None), item)
                                                for key, item in value.items()})
    return value


def _end_run(reason: str) -> None:
    """End this process's trial run, if one is under way, and wait for its `fit()` to return."""
    global _current
    with _lock:
        run, _current = _current, None
    if run is None:
        return  # the loop has returned, or never started
    run.callback.close()
    # The trial's thread waits inside `tune.report` for Tune's next `train()` call, which will not come
    # (ray/train/_internal/session.py, `_report_training_result`): let it go on, so that fit() winds down.
    get_session().continue_lock.release()
    # No timeout of ours: Tune kills a trial whose clean-up takes longer than TUNE_FORCE_TRIAL_CLEANUP_S (600 s).
    run.trainer.stop(reason)
    logger.info("%s: its run %s ended", reason, run.trainer.run_config.name)


class TrialMixin:
    """A base class of the Tune trainable that wraps a TorchTrainer (`TorchTrainer.__mixins__`, read by
    Tune's `wrap_function`): when Tune stops the trial or hands its actor to another trial, the run ends
    cleanly first. Tune's own `cleanup` only wakes the trial's thread with SystemExit and lets the
    process go, which would take the supervisor with it mid-run."""

    trial_id: str

    def cleanup(self) -> None:
        _end_run(f"Tune stopped trial {self.trial_id}")
        super().cleanup()  # type: ignore[misc]

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        _end_run("Tune reuses the trial's actor for another trial")
        return super().reset_config(new_config)  # type: ignore[misc]


__all__ = ["TuneReportCallback", "CHECKPOINT_PATH_KEY"]
