"""What every worker of a run is given (`WorkerSpec`), and what it tells the loop of its run (`RunInfo`).

The driver builds them, the supervisor hands them on, the workers use them. The supervisor never
runs the loop: the loop's own objects (its function, its config, its datasets, the checkpoint it
starts from: `LoopSpec`) travel through it as bytes, so that it does not import what the loop
imports (torch alone adds ~1.3 s to the start of every run).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ray import cloudpickle

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import CheckpointConfig, ElasticConfig

if TYPE_CHECKING:
    from elastic_train.checkpoint.checkpoint import Checkpoint


@dataclass(frozen=True)
class RunInfo:
    """What the driver knows of the run that every worker's context tells the loop."""

    name: str
    trial_name: str | None = None  # the Ray Tune trial this run belongs to, if any
    trial_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # TorchTrainer(metadata=...)
    run_id: str = ""  # unique to this fit(): the run record (run.json) names it


@dataclass(frozen=True)
class LoopSpec:
    """The user's loop and what it is given; opened by the workers only."""

    train_fn: Callable[..., Any]
    train_config: dict[str, Any] | None  # None: the loop takes no argument
    initial_checkpoint: Checkpoint | None = None  # TorchTrainer(resume_from_checkpoint=): until the run has its own
    datasets: Mapping[str, Any] = field(default_factory=dict)  # ingest/config.py DatasetSource by name
    data_context: Any = None  # with datasets: the driver's ray.data.DataContext, the workers' too (as in Ray)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a run needs; built once by the trainer."""

    loop: bytes  # a LoopSpec, pickled (`of`, `open_loop`): the supervisor hands it on unopened
    backend: str
    elastic: ElasticConfig
    storage: RunStorage
    run: RunInfo
    checkpointing: CheckpointConfig  # which reported checkpoints are stored (a rank decides for its live parts)
    chdir: bool = True  # the loop runs in the run's working directory (RAY_CHDIR_TO_TRIAL_DIR=0: it does not)
    with_datasets: bool = False  # the loop reads Ray Data datasets: a worker warms Ray Data up as it starts

    @classmethod
    def of(cls, loop: LoopSpec, **given: Any) -> WorkerSpec:
        return cls(cloudpickle.dumps(loop), with_datasets=bool(loop.datasets), **given)

    def open_loop(self) -> LoopSpec:
        """The loop. One that cannot be unpickled here (its module is on the driver's path alone) is a
        loop that raises that error when it runs: the rank fails as under Ray Train, where the loop
        is unpickled in `run_train_fn` (counted against `max_failures`, its traceback reported)."""
        try:
            return cloudpickle.loads(self.loop)
        except Exception as exc:  # noqa: BLE001 - raised again when the loop runs
            return LoopSpec(functools.partial(_raise, exc), None)


def _raise(exc: BaseException) -> None:
    raise exc
