"""`TransformersTrainer`: a `TorchTrainer` for a loop that builds and runs a `transformers.Trainer`."""

from __future__ import annotations

from typing import Any, Callable

from elastic_train.trainer import TorchTrainer


class TransformersTrainer(TorchTrainer):
    """Runs `train_loop_per_worker`, a loop that builds a `transformers.Trainer` and calls its
    `train()`, on elastic, fault-tolerant workers: `TransformersTrainer(train_func,
    scaling_config=...)` takes every argument `TorchTrainer` takes.

    Each worker runs the loop in the run's working directory (`TrainContext.working_dir`), as with
    every TorchTrainer, so a relative `TrainingArguments(output_dir="./output")` is the run's own.
    What it adds: the loop's workers import `elastic_train.huggingface`, which resets Accelerate's
    state at every generation.

    Checkpoints and resumption are the loop's, as in Ray: add `RayTrainReportCallback` and
    `prepare_trainer` (from `elastic_train.huggingface.transformers`) and resume from
    `get_checkpoint()`. A loop without them reports nothing: after a worker is lost it starts
    `trainer.train()` again from its first step (in the survivors' processes).
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], **kwargs: Any):
        if not isinstance(train_loop_per_worker, _ImportsThisPackage):  # `restore()` passes the stored one
            train_loop_per_worker = _ImportsThisPackage(train_loop_per_worker)
        super().__init__(train_loop_per_worker, **kwargs)


class _ImportsThisPackage:
    """The user's loop. Its class lives in this package, so a worker imports the package (and
    registers the Accelerate reset) when it unpickles the loop."""

    def __init__(self, loop: Callable[..., Any]):
        self.loop = loop
        self.__wrapped__ = loop  # TorchTrainer checks the user's signature: inspect.signature follows it

    def __call__(self, *config: Any) -> Any:
        return self.loop(*config)


__all__ = ["TransformersTrainer"]
