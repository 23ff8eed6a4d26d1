"""Ray Tune over elastic_train: `ray.tune.integration.ray_train` → `elastic_train.tune` (needs the
`tune` extra, `pip install elastic_train[tune]`).

Two ways to tune, as with Ray Train:

* **A trainer as the trainable** (the Tuner pattern of Ray Train's V1 guides):
  `tune.Tuner(TorchTrainer(train_func, scaling_config=...), param_space={"lr": tune.loguniform(1e-5, 1e-2)},
  tune_config=tune.TuneConfig(num_samples=20, scheduler=ASHAScheduler(metric="loss", mode="min")))`.
  Each trial fits a copy of the trainer built from the trial's config: a key that names a TorchTrainer
  argument (`train_loop_config`, `scaling_config`, `run_config`, ...) replaces that argument (a dict
  updates the argument's fields or keys instead), every other key goes into `train_loop_config`. Each
  report reaches Tune through a `TuneReportCallback`. When Tune stops the trial (a scheduler such as
  ASHA, a stopper, the end of the experiment), the run ends cleanly before the trial's process goes: the workers
  unwind, the newest checkpoint is committed, no torn folder stays.
* **A function trainable** (Ray Train V2's guides): a function that builds a TorchTrainer per trial,
  with `RunConfig(name=f"...{tune.get_context().get_trial_id()}", callbacks=[TuneReportCallback()])`.
  When Tune stops such a trial its process ends under the run (Tune gives a function no hook to end
  it first): the supervisor goes with the process, the workers end themselves, the committed
  checkpoints stay, and a checkpoint whose upload was under way stays torn until a run of that name
  starts again and sweeps it. Use the first pattern for clean stops.

**Runs and restarts.** In the first pattern a trial's run is named `<RunConfig.name or
"TorchTrainer">_<trial id>` and stored under the trainer's `RunConfig.storage_path` (Tune's own
`storage_path` keeps Tune's records). A trial that Tune restarts (`tune.FailureConfig(max_failures=...)`,
`Tuner.restore`) keeps its trial id, so its run resumes from its newest committed checkpoint:
`get_checkpoint()` returns it in the loop. In the second pattern, put the trial id in the run's name
for the same effect.

**Checkpoints.** Reports reach Tune once their checkpoint is committed, with the checkpoint's folder
(a path, or a URL for object stores) as the metric "checkpoint_path", as Ray's V2 callback does. The
checkpoint is not copied into Tune's storage, so Tune's `Result.checkpoint` is None: read
`best.metrics["checkpoint_path"]`, or the run folder above it
(`elastic_train.Result.from_path(os.path.dirname(path))`). For the same reason Tune has no checkpoint
to hand from trial to trial: schedulers that stop trials (ASHA, HyperBand, median stopping) work;
PBT's exploit, which restarts a trial from another's checkpoint, does not.

**Sizing.** Tune places each trial's process (the run's driver: it runs `fit()` and the callbacks, and
owns the supervisor) with the trial's resources: 1 CPU unless `tune.with_resources(trainer, {...})`
says otherwise. The run's workers are not part of them: each run's supervisor asks Ray for its
`num_workers` workers (1 CPU each, plus 1 GPU with `use_gpu`, or `resources_per_worker`), outside the
trial's placement group, and Tune does not see them. So bound the trials that run at once with
`TuneConfig(max_concurrent_trials=...)`: for each resource R, trials × (R per trial + min workers ×
R per worker) must fit in the cluster's R. With 16 CPUs and 8 GPUs, `num_workers=4, use_gpu=True`
takes 4 GPUs and 5 CPUs a trial: 2 trials at once.
Without the bound, Tune starts a trial for every CPU it sees free, and a run that cannot place its
workers waits `ElasticConfig.min_workers_timeout_s` and fails. An elastic run (`num_workers=(min,
max)`) starts with what is free (at least min) and grows into what finished trials release.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Mapping

import ray.tune
from ray.train._internal.session import get_session
from ray.tune.trainable.trainable_fn_utils import _in_tune_session

from elastic_train.callbacks import UserCallback
from elastic_train.checkpoint.checkpoint import Checkpoint, is_local

if TYPE_CHECKING:
    from elastic_train.trainer import TorchTrainer

logger = logging.getLogger(__name__)

CHECKPOINT_PATH_KEY = "checkpoint_path"  # Ray's name for it (ray/tune/integration/ray_train.py)


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
    trainer: TorchTrainer
    callback: TuneReportCallback


_lock = threading.Lock()
_current: _TrialRun | None = None  # the run of the trial this process hosts: Tune runs one at a time per actor


def run_trial(trainer: TorchTrainer, config: dict[str, Any]) -> None:
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
    trainer: TorchTrainer, config: Mapping[str, Any], trial_id: str, callback: UserCallback
) -> TorchTrainer:
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
