"""`DataParallelTrainer` and `TorchTrainer`, Ray Train's entry points: check the user's input (before
any actor starts), then `fit()` runs one run from the driver: its storage and run record, the
supervisor, the feed it follows, the `Result` or error it ends with (driver/)."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import logging
import sys
import threading
import uuid
import warnings
from typing import Any, Callable, Mapping

import ray

from elastic_train.backend import BackendConfig, check_backend
from elastic_train.callbacks import CallbackRunner, TrainRunContext
from elastic_train.checkpoint import Checkpoint
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, RunConfig, ScalingConfig
from elastic_train.constants import chdir_to_trial_dir, torch_shutdown_timeout_s
from elastic_train.driver.arguments import as_config, check_loop, checked_metadata
from elastic_train.driver.follow import Dispatch, follow
from elastic_train.driver.launch import attach, start_supervisor
from elastic_train.driver.outcome import run_result
from elastic_train.driver.restore import is_run, restored_arguments
from elastic_train.errors import ConfigError, ControllerError
from elastic_train.progress import Progress
from elastic_train.result import Result
from elastic_train.run_folder.record import RunRecord
from elastic_train.run_spec import LoopSpec, RunInfo, WorkerSpec
from elastic_train.torch.config import TorchConfig
from elastic_train.unsupported import TRAIN_NAMES

logger = logging.getLogger(__name__)


class DataParallelTrainer:
    """Runs `train_loop_per_worker` on elastic, fault-tolerant workers (Ray Train's API).

    Each generation's workers form a `torch.distributed` group (report()'s barrier is an all-reduce
    over it): a `TorchConfig` as `backend_config` sets it up (backend; its `timeout_s` replaces
    `ElasticConfig.collective_timeout_s`); a backend with hooks of its own is refused (backend.py).
    `metadata` reaches the loop as
    `get_context().get_metadata()`. `resume_from_checkpoint` is what `get_checkpoint()` returns when
    the run has no checkpoint of its own yet (in storage, from an earlier run with this name, or in
    the workers' memory); a dict checkpoint travels with the run, a directory one must be readable
    where the workers run (shared storage, or a URL). `datasets` (Ray Data datasets by name, or
    functions returning them) reach the loop through `get_dataset_shard(name)`, split as
    `dataset_config` (a `DataConfig`) says, each row once an epoch across resizes (ingest/). Ray's
    checkpoint validation (`validation_config`) is not supported: a `ConfigError` names what to use
    instead.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        backend_config: BackendConfig | None = None,
        scaling_config: ScalingConfig | Mapping[str, Any] | None = None,
        run_config: RunConfig | Mapping[str, Any] | None = None,
        datasets: Mapping[str, Any] | None = None,
        dataset_config: Any = None,
        validation_config: Any = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ):
        if validation_config:
            raise ConfigError(f"{type(self).__name__}(validation_config=...): {TRAIN_NAMES['ValidationConfig']}")
        if datasets is not None and not isinstance(datasets, Mapping):
            raise ConfigError(f"datasets must map names to Ray Data datasets, got {type(datasets).__name__}.")
        self.datasets = dict(datasets or {})
        self.dataset_config = dataset_config
        self._data_context = None  # with datasets, the driver's ray.data.DataContext now, for the workers
        if self.datasets or dataset_config is not None:
            from elastic_train.ingest.config import check_datasets, driver_data_context

            self.dataset_config = check_datasets(self.datasets, dataset_config)
            self._data_context = driver_data_context() if self.datasets else None
        self._loop_takes_config = check_loop(train_loop_per_worker, train_loop_config)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        if backend_config is not None and not isinstance(backend_config, self._BACKEND_CLASS):
            raise ConfigError(f"{self._BACKEND_ARGUMENT} must be an {self._BACKEND_PATH}, got "
                              f"{type(backend_config).__name__}.")
        if backend_config is not None:
            check_backend(backend_config)
        self.backend_config = backend_config
        self.scaling_config: ScalingConfig = as_config(ScalingConfig, scaling_config, "scaling_config")
        self.run_config: RunConfig = as_config(RunConfig, run_config, "run_config")
        self.metadata = checked_metadata(metadata)
        if resume_from_checkpoint is not None and not isinstance(resume_from_checkpoint, Checkpoint):
            raise ConfigError("resume_from_checkpoint must be an elastic_train.Checkpoint, got "
                              f"{type(resume_from_checkpoint).__name__}.")
        self.resume_from_checkpoint = resume_from_checkpoint
        self._backend = (self._torch_config or TorchConfig()).resolve_backend(self.scaling_config.use_gpu)
        self._init_run_state()

    # How the constructor takes the backend's config.
    _BACKEND_ARGUMENT, _BACKEND_CLASS, _BACKEND_PATH = "backend_config", BackendConfig, "elastic_train.BackendConfig"

    @classmethod
    def argument_names(cls) -> list[str]:
        """The constructor's arguments (a subclass takes the backend's config under its own name)."""
        names = [name for name in inspect.signature(DataParallelTrainer).parameters if name != "backend_config"]
        return names + [cls._BACKEND_ARGUMENT]

    @property
    def _torch_config(self) -> TorchConfig | None:
        return self.backend_config if isinstance(self.backend_config, TorchConfig) else None

    def _init_run_state(self) -> None:
        """What `stop()` shares with the `fit()` under way (not pickled: each copy fits on its own)."""
        self._lock = threading.Lock()
        self._fitting = False
        self._supervisor: Any = None
        self._stop_reason: str | None = None
        self._idle = threading.Event()
        self._idle.set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for private in ("_lock", "_fitting", "_supervisor", "_stop_reason", "_idle"):
            del state[private]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_run_state()

    @classmethod
    def restore(
        cls,
        path: str,
        train_loop_per_worker: Callable[..., Any] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        storage_filesystem: Any = None,
        **kwargs: Any,
    ) -> "DataParallelTrainer":
        """A trainer that goes on with the run stored at `path` (a `Result.path`), from its newest
        committed checkpoint; its `fit()` is the run's next.

        Without `train_loop_per_worker`, the loop and the trainer's other arguments are loaded from
        the run's `trainer.pkl`, which `fit()` wrote with cloudpickle. **This unpickles, that is
        runs, code read from storage: only restore runs from storage that only you can write.** The
        loop's module must be importable here. Pass the loop to read nothing but JSON and manifests.
        `kwargs` (any argument of the trainer: `run_config` to add callbacks, `train_loop_config`,
        `scaling_config`, ...) replace the stored ones; `datasets` are not stored: pass them again, as
        in Ray. `storage_options` or, as in Ray, a
        `storage_filesystem` that `path` is on (or those of the `run_config` passed) open the path:
        credentials are never stored in the run's folder.
        """
        train_loop_per_worker, arguments = restored_arguments(cls.__name__, path, train_loop_per_worker,
                                                              storage_options, storage_filesystem, kwargs)
        return cls(train_loop_per_worker, **arguments)

    @classmethod
    def can_restore(cls, path: str, storage_filesystem: Any = None, *,
                    storage_options: Mapping[str, Any] | None = None) -> bool:
        """Whether `path` holds a run that `restore(path)` can go on with (Ray Train's check before
        `restore`): its run record or a committed checkpoint."""
        return is_run(RunStorage.at(path, storage_options, filesystem=storage_filesystem))

    def stop(self, reason: str, timeout_s: float | None = None) -> bool:
        """End the `fit()` under way cleanly, from another thread (Tune's trial clean-up calls it):
        the members leave, the newest checkpoint in memory is committed, and `fit()` returns its
        `Result`. Waits up to `timeout_s` (None: as long as it takes) for `fit()` to return;
        True once it has, or when none was under way."""
        with self._lock:
            if not self._fitting:
                return True
            self._stop_reason = reason
            supervisor = self._supervisor
        if supervisor is not None:  # else fit() asks for the stop as soon as its supervisor exists
            supervisor.stop_run.remote(reason)
        return self._idle.wait(timeout_s)

    def fit(self) -> Result:
        """Run the training to its end and return its `Result`.

        Raises `TrainingFailedError` when the run fails, as Ray Train does: `WorkerGroupError` (the
        user's code raised more often than `FailureConfig.max_failures` allows; `worker_failures`
        maps each rank to its exception), `PreemptionError` (preemptions spent
        `max_preemption_failures`), or `ControllerError` (anything else: capacity never came,
        storage refused, a callback raised). `Result.from_path(path)` of the run's folder still
        reads what the run left: its metrics, events and committed checkpoints.
        """
        with self._lock:
            if self._fitting:
                raise ConfigError("fit() is already running on this trainer; make another trainer to run another.")
            self._fitting = True
            self._idle.clear()
        # Ray's local mode (num_workers=0) runs the loop without Ray; here it runs in one worker, on a
        # Ray instance that is stopped again if this fit() started it, so a later ray.init() works.
        local_ray = self.scaling_config.num_workers == 0 and not ray.is_initialized()
        try:
            return self._fit()
        finally:
            if local_ray:
                ray.shutdown()
            with self._lock:
                self._fitting, self._supervisor, self._stop_reason = False, None, None
                self._idle.set()

    def _fit(self) -> Result:
        run = self.run_config
        name = run.name or f"{self._name}_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
        elastic = run.elastic_config or ElasticConfig()
        if self._torch_config is not None:
            elastic = dataclasses.replace(elastic, collective_timeout_s=float(self._torch_config.timeout_s))
        if (shutdown_s := torch_shutdown_timeout_s()) is not None:  # Ray's environment variable
            elastic = dataclasses.replace(elastic, process_group_destroy_timeout_s=shutdown_s)
        storage = RunStorage(run.resolved_storage_path(), name, run.storage_options, RetryPolicy.of(elastic),
                             run.storage_filesystem)
        if storage.process_local:
            raise ConfigError(
                f"storage_path {storage.storage_path!r}: memory:// is private to one process, and Ray workers run in "
                "processes of their own. Use a local folder or an object store (s3://...)."
            )
        storage.check_writable()
        trial_name, trial_id = _tune_trial()
        run_id = uuid.uuid4().hex
        loop = LoopSpec(self.train_loop_per_worker, (self.train_loop_config or {}) if self._loop_takes_config else None,
                        self.resume_from_checkpoint)

        def spec_of(loop: LoopSpec) -> WorkerSpec:
            return WorkerSpec.of(loop, backend=self._backend, elastic=elastic, storage=storage,
                                 run=RunInfo(name, trial_name, trial_id, self.metadata, run_id),
                                 checkpointing=run.checkpoint_config or CheckpointConfig(), chdir=chdir_to_trial_dir())

        if not ray.is_initialized():
            ray.init()
        if self.scaling_config.use_gpu and not ray.cluster_resources().get("GPU"):
            raise ConfigError(
                "ScalingConfig(use_gpu=True), but the Ray cluster has no GPU: set use_gpu=False to train on "
                "CPUs (gloo), or start Ray on machines with GPUs."
            )
        if not self.datasets:
            return self._run(spec_of(loop), run, elastic)
        from elastic_train.driver.launch import start_coordinators, stop_coordinators
        from elastic_train.ingest.config import prepare_datasets

        sources = prepare_datasets(self.datasets, self.dataset_config, self.scaling_config.total_resources.get("CPU", 0))
        loop = dataclasses.replace(loop, datasets=start_coordinators(name, sources), data_context=self._data_context)
        try:
            return self._run(spec_of(loop), run, elastic)
        finally:
            stop_coordinators(loop.datasets)

    def _run(self, spec: WorkerSpec, run: RunConfig, elastic: ElasticConfig) -> Result:
        """Run the supervisor and follow it to the run's `Result`."""
        storage, name, run_id = spec.storage, spec.run.name, spec.run.run_id
        trial_name, trial_id = spec.run.trial_name, spec.run.trial_id
        record = RunRecord(storage, run_id, self._config_record(), elastic.run_record_interval_s)
        record.start(self._stored_arguments())
        storage.mark_run(run_id)
        callbacks = CallbackRunner(list(run.callbacks or ()), TrainRunContext(
            run_id=run_id, name=name, path=storage.url(), run_config=run,
            train_loop_config=self.train_loop_config, scaling_config=self.scaling_config,
            torch_config=self._torch_config or TorchConfig(), metadata=self.metadata, trial_name=trial_name,
            trial_id=trial_id))
        supervisor = start_supervisor(name, spec, self.scaling_config, run.failure_config or FailureConfig())
        with self._lock:
            self._supervisor, stop_reason = supervisor, self._stop_reason
        if stop_reason is not None:
            supervisor.stop_run.remote(stop_reason)
        progress = Progress(name, elastic.verbosity, elastic.progress_interval_s)
        try:
            summary = follow(supervisor, Dispatch(callbacks, record, storage, progress), record,
                             elastic.run_record_interval_s)
        except ray.exceptions.RayError as exc:  # the supervisor died for good, or its run() raised
            error = ControllerError(exc)
            record.finish("errored", error=error)
            raise error from exc
        finally:
            progress.close()
            ray.kill(supervisor)
            storage.unmark_run(run_id)
        result = run_result(summary, storage)
        error = result.error
        try:
            callbacks("on_run_end", result)
        except ControllerError as callback_error:
            if error is not None:
                logger.warning("on_run_end raised after the run failed; fit() raises the run's error: %s",
                               callback_error)
            else:
                error = result.error = callback_error
        record.finish("errored" if error is not None else summary.state.value, summary, error)
        if error is not None:
            raise error
        return result

    def _config_record(self) -> dict[str, Any]:
        """The trainer's arguments as the run record's JSON shows them (callbacks by class name,
        storage options by key: credentials stay out of storage)."""
        run = {f.name: getattr(self.run_config, f.name) for f in dataclasses.fields(RunConfig)}
        run["callbacks"] = [type(c).__name__ for c in run["callbacks"] or ()]
        run["storage_options"] = sorted(run["storage_options"] or ())
        return {"train_loop_config": self.train_loop_config, "scaling_config": self.scaling_config, "run_config": run,
                self._BACKEND_ARGUMENT: self.backend_config, "metadata": self.metadata}

    def _stored_arguments(self) -> dict[str, Any]:
        """What `trainer.pkl` keeps for `restore()`: the loop and the arguments of a new trainer,
        without callbacks (objects of the driver's), storage credentials (storage_options, and the
        filesystem object that may hold them) or resume_from_checkpoint (a restored run resumes from
        its own checkpoints)."""
        return {"train_loop_per_worker": self.train_loop_per_worker, "train_loop_config": self.train_loop_config,
                self._BACKEND_ARGUMENT: self.backend_config, "scaling_config": self.scaling_config,
                "run_config": dataclasses.replace(self.run_config, callbacks=None, storage_options=None,
                                                  storage_filesystem=None),
                "metadata": self.metadata}

    # -- Ray Tune: `tune.Tuner(TorchTrainer(...), param_space=...)` runs this trainer as a trainable
    # (Tune's wrap_function reads `__call__` and `__mixins__`; `_name` names the experiment and its trials).
    _name = "DataParallelTrainer"

    def __call__(self, config: dict[str, Any]) -> None:
        """One Tune trial: fit this trainer with the trial's config over its arguments (elastic_train.tune)."""
        from elastic_train.tune import run_trial

        run_trial(self, config)

    @property
    def __mixins__(self) -> tuple[type, ...]:
        """A base class for the trial's trainable: it ends the run cleanly when Tune stops the trial."""
        from elastic_train.tune import TrialMixin

        return (TrialMixin,)


class TorchTrainer(DataParallelTrainer):
    """A `DataParallelTrainer` whose backend is a `TorchConfig` (Ray Train's `TorchTrainer`):
    `torch_config` sets up each generation's process group. Its other arguments are
    `DataParallelTrainer`'s: `train_loop_config`, `scaling_config`, `run_config`, `metadata`,
    `resume_from_checkpoint`, `datasets`, `dataset_config` (`validation_config` is refused)."""

    _BACKEND_ARGUMENT, _BACKEND_CLASS, _BACKEND_PATH = "torch_config", TorchConfig, "elastic_train.torch.TorchConfig"
    _name = "TorchTrainer"

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, torch_config: TorchConfig | None = None,
                 **kwargs: Any):
        """`kwargs`: the other arguments of `DataParallelTrainer`."""
        super().__init__(train_loop_per_worker, backend_config=torch_config, **kwargs)

    @property
    def torch_config(self) -> TorchConfig | None:
        return self.backend_config


def _tune_trial() -> tuple[str | None, str | None]:
    """The name and id of the Ray Tune trial this fit() runs in; (None, None) outside Tune. A trial
    runs with ray.tune imported: without it there is none, and nothing is imported to find out."""
    if "ray.tune" not in sys.modules:
        return None, None
    import ray.tune

    with warnings.catch_warnings():  # outside a trial, Ray warns that there is no trial, and answers None
        warnings.simplefilter("ignore")
        context = ray.tune.get_context()
        return context.get_trial_name(), context.get_trial_id()


# attach: to find a live run (docs/operations/seeing_a_run.md)
__all__ = ["DataParallelTrainer", "TorchTrainer", "Checkpoint", "attach"]
