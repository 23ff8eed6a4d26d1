"""`TorchTrainer`: validates the user's input, starts the supervisor, and turns its summary into a
`Result`. Everything that can be wrong with the input fails here, before any actor starts."""

from __future__ import annotations

import datetime
import inspect
import logging
from typing import Any, Callable, Mapping

import ray

from elastic_train.checkpoint import Checkpoint
from elastic_train.config import (
    CheckpointConfig,
    ElasticConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    checked_options,
)
from elastic_train.errors import ConfigError, TrainingFailedError
from elastic_train.result import Result
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.supervisor.actor import Supervisor
from elastic_train.supervisor.state import RunState
from elastic_train.worker.actor import WorkerSpec
from elastic_train.worker.context import RunInfo

logger = logging.getLogger(__name__)


def _as_config(cls: type, value: Any, owner: str) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return checked_options(cls, value)
    raise ConfigError(f"{owner} must be a {cls.__name__} or a dict of its options, got {type(value).__name__}.")


def _check_loop(fn: Any, config: Any) -> bool:
    """Validate the loop and its config; returns whether the loop takes the config argument."""
    if not callable(fn):
        raise ConfigError(
            f"train_loop_per_worker must be a function, got {type(fn).__name__}: "
            "pass the function itself, e.g. TorchTrainer(train_func, ...), not train_func()."
        )
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError(f"train_loop_config must be a dict, got {type(config).__name__}.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > 1:
        raise ConfigError(
            "train_loop_per_worker must take no argument or one (the train_loop_config dict); "
            f"{getattr(fn, '__name__', fn)} requires {len(required)}."
        )
    takes_config = bool(positional) or varargs
    if config is not None and not takes_config:
        raise ConfigError(
            "train_loop_config was given, but train_loop_per_worker takes no argument to receive it: "
            "add a `config` parameter."
        )
    return takes_config


HEAD_NODE_RESOURCE = "node:__internal_head__"


def _on_head_node() -> dict[str, float]:
    """Ray resources that place the supervisor on the head node, which the cluster cannot lose without
    losing itself: it then never goes down with a worker node (the driver's own node may be one)."""
    has_head = any(n["Alive"] and HEAD_NODE_RESOURCE in n["Resources"] for n in ray.nodes())
    return {HEAD_NODE_RESOURCE: 0.001} if has_head else {}


def supervisor_name(run_name: str) -> str:
    """The Ray actor name of a run's supervisor: `ray.get_actor(supervisor_name(name))` attaches to it."""
    return f"elastic_train:{run_name}"


class TorchTrainer:
    """Runs `train_loop_per_worker` on elastic, fault-tolerant workers (Ray Train's API)."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        scaling_config: ScalingConfig | Mapping[str, Any] | None = None,
        run_config: RunConfig | Mapping[str, Any] | None = None,
    ):
        self._loop_takes_config = _check_loop(train_loop_per_worker, train_loop_config)
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config) if train_loop_config is not None else None
        self.scaling_config: ScalingConfig = _as_config(ScalingConfig, scaling_config, "scaling_config")
        self.run_config: RunConfig = _as_config(RunConfig, run_config, "run_config")

    @classmethod
    def restore(cls, path: str, train_loop_per_worker: Callable[..., Any], **kwargs: Any) -> "TorchTrainer":
        """A trainer that resumes the run stored at `path` from its newest committed checkpoint."""
        run_config = kwargs.pop("run_config", None) or RunConfig()
        storage = RunStorage.at(path, run_config.storage_options)
        if not storage.committed():
            raise ConfigError(
                f"TorchTrainer.restore({path!r}): no committed checkpoint there. Pass the folder of an earlier run "
                "(its Result.path), with the same RunConfig.storage_options."
            )
        run_config = RunConfig(**{**run_config.__dict__, "storage_path": storage.storage_path, "name": storage.name})
        return cls(train_loop_per_worker, run_config=run_config, **kwargs)

    def fit(self) -> Result:
        run = self.run_config
        name = run.name or f"TorchTrainer_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
        elastic = run.elastic_config or ElasticConfig()
        storage = RunStorage(run.resolved_storage_path(), name, run.storage_options, elastic.storage_retry())
        if storage.process_local:
            raise ConfigError(
                f"storage_path {storage.storage_path!r}: memory:// is private to one process, and Ray workers run in "
                "processes of their own. Use a local folder or an object store (s3://...)."
            )
        storage.check_writable()
        spec = WorkerSpec(
            train_fn=self.train_loop_per_worker,
            train_config=(self.train_loop_config or {}) if self._loop_takes_config else None,
            backend="nccl" if self.scaling_config.use_gpu else "gloo",
            elastic=elastic,
            storage=storage,
            run=RunInfo(name),
        )
        if not ray.is_initialized():
            ray.init()
        if self.scaling_config.use_gpu and not ray.cluster_resources().get("GPU"):
            raise ConfigError(
                "ScalingConfig(use_gpu=True), but the Ray cluster has no GPU: set use_gpu=False to train on "
                "CPUs (gloo), or start Ray on machines with GPUs."
            )
        supervisor = ray.remote(Supervisor).options(
            name=supervisor_name(name), num_cpus=0, max_concurrency=10_000, resources=_on_head_node(),
            # Ray restarts a dead supervisor, and re-sends the calls it had in flight (this one's too).
            max_restarts=elastic.supervisor_max_restarts, max_task_retries=-1,
        ).remote(
            spec,
            self.scaling_config,
            run.failure_config or FailureConfig(),
            run.checkpoint_config or CheckpointConfig(),
        )
        try:
            summary = ray.get(supervisor.run.remote())
        finally:
            ray.kill(supervisor)
        checkpoints = [(Checkpoint(storage.folder(c.attempt), storage.fs, c.manifest), c.metrics)
                       for c in summary.checkpoints]
        error = None
        if summary.state is RunState.ERRORED:
            error = TrainingFailedError(f"Training failed:\n{summary.error}")
        return Result(
            metrics=summary.metrics,
            checkpoint=checkpoints[-1][0] if checkpoints else None,
            path=storage.url(),
            error=error,
            metrics_history=summary.metrics_history,
            best_checkpoints=checkpoints,
            events=summary.events,
        )


__all__ = ["TorchTrainer", "Checkpoint"]
