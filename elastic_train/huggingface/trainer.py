"""`TransformersTrainer`: a `TorchTrainer` for a loop that builds and runs a `transformers.Trainer`."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any, Callable

from elastic_train.api import get_context
from elastic_train.trainer import TorchTrainer


class TransformersTrainer(TorchTrainer):
    """Runs `train_loop_per_worker`, a loop that builds a `transformers.Trainer` and calls its
    `train()`, on elastic, fault-tolerant workers: `TransformersTrainer(train_func,
    scaling_config=...)` takes every argument `TorchTrainer` takes.

    What it adds to `TorchTrainer`, as Ray Train does for every worker: each worker runs the loop
    in the run's working directory on its machine (`run_working_dir()`), shared by the run's
    workers there, so a relative `TrainingArguments(output_dir="./output")` is the run's own and
    two runs on one machine do not write into each other's checkpoint folders. And the loop's
    workers import `elastic_train.huggingface`, which resets Accelerate's state at every
    generation.

    Checkpoints and resumption are the loop's, as in Ray: add `RayTrainReportCallback` and
    `prepare_trainer` (from `elastic_train.huggingface.transformers`) and resume from
    `get_checkpoint()`. A loop without them reports nothing: after a worker is lost it starts
    `trainer.train()` again from its first step (in the survivors' processes).
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], **kwargs: Any):
        if not isinstance(train_loop_per_worker, _InRunWorkingDir):  # `restore()` passes the stored one
            train_loop_per_worker = _InRunWorkingDir(train_loop_per_worker)
        super().__init__(train_loop_per_worker, **kwargs)


class _InRunWorkingDir:
    """The user's loop, run in the run's working directory. Its class lives in this package, so a
    worker imports the package (and registers the Accelerate reset) when it unpickles the loop."""

    def __init__(self, loop: Callable[..., Any]):
        self.loop = loop
        self.__wrapped__ = loop  # TorchTrainer checks the user's signature: inspect.signature follows it

    def __call__(self, *config: Any) -> Any:
        os.chdir(run_working_dir())
        return self.loop(*config)


def run_working_dir() -> str:
    """The run's working directory on this machine: `<tmp>/elastic_train/working_dirs/<run
    name>_<hash of the run's storage folder>` (the hash tells apart runs of one name stored elsewhere)."""
    context = get_context()
    digest = hashlib.sha1(context.get_trial_dir().encode()).hexdigest()[:8]
    path = os.path.join(tempfile.gettempdir(), "elastic_train", "working_dirs",
                        f"{context.get_experiment_name()}_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


__all__ = ["TransformersTrainer", "run_working_dir"]
