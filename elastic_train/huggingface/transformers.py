"""Hugging Face Transformers on elastic_train: Ray Train's `ray.train.huggingface.transformers` names.

`RayTrainReportCallback` reports each checkpoint the `Trainer` saves, and `prepare_trainer`
readies the `Trainer` for the run, as Ray's do. A loop written for Ray resumes the same way:

    checkpoint = elastic_train.get_checkpoint()
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as d:
            trainer.train(resume_from_checkpoint=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))

Here a lost worker does not restart the run: the survivors' loops unwind out of `trainer.train()`
(the exceptions elastic_train raises there are not caught by the Trainer), the loop runs again in
the same processes at the new world size, and `get_checkpoint()` is the newest reported checkpoint,
from the survivors' memory. What `prepare_trainer` adds for that: the training data is dealt
in global batches that do not depend on the world size, so the Trainer's own resumption (it skips
the batches its global step says the resumed epoch has seen) lands on the same sample at any size.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
import types
from typing import Any

from torch.utils.data import DataLoader

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, has_length
    from transformers.utils import is_datasets_available
except ImportError as exc:
    raise ModuleNotFoundError(
        "Hugging Face Transformers isn't installed. To install it, run 'pip install transformers accelerate' "
        "(or elastic_train's 'transformers' extra)."
    ) from exc

from elastic_train.api import get_context, report
from elastic_train.checkpoint import Checkpoint
from elastic_train.errors import ConfigError
from elastic_train.torch.data import ElasticBatchSampler
from elastic_train.unsupported import unsupported_getattr
from elastic_train.worker.loop.current import get_session

logger = logging.getLogger(__name__)

_RNG_STATE = re.compile(r"rng_state(_\d+)?\.pth")  # the Trainer's per-process RNG state files


class RayTrainReportCallback(TrainerCallback):
    """Reports to elastic_train each time the `Trainer` saves a checkpoint (`on_save`), as Ray's does:
    the metrics of every log entry so far, merged (newer values win), with the saved folder as the
    checkpoint's `checkpoint/` folder (`CHECKPOINT_NAME`). Every rank reports: `report()` is a
    barrier. Saving is the Trainer's (`save_strategy`, `save_steps`), so a checkpoint is reported
    every `save_steps` steps and at the end of training; set `logging_steps` so that the metrics you
    want are logged by then.

    What differs from Ray's, and why:
    * The checkpoint is the folder just saved (`<output_dir>/checkpoint-<global step>`), not the
      newest in `output_dir`: after an in-place rewind, a later folder of the abandoned attempt may
      still be there.
    * Each rank reports the files it wrote: the world's process zero everything but the other
      processes' RNG states, every other rank its own `rng_state_<rank>.pth`. Ranks' files merge by
      name, so the checkpoint is whole, and no rank reads a file that another is still writing (in
      a shared `output_dir`, Ray's callback copies other ranks' files as they are being written).
    * Nothing is copied on disk: the files are linked into a temporary folder that `report()`
      reads into memory (its snapshot, which survives this worker), then removed.
    * The merged metrics are kept between saves, not merged again from the whole log history.
    """

    CHECKPOINT_NAME = "checkpoint"

    def __init__(self) -> None:
        super().__init__()
        self._history: list[dict[str, Any]] | None = None  # the log history merged so far
        self._merged: dict[str, Any] = {}
        self._seen = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Refuse a Trainer that does not see the run's world: every rank would report as process zero."""
        _check_world(args, "RayTrainReportCallback")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Report the latest metrics with the checkpoint just saved."""
        metrics = self._metrics(state.log_history)
        folder = os.path.abspath(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))
        own = _own_files(folder, args, state) if os.path.isdir(folder) else []
        if not own:
            report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="elastic_train_hf_") as tmp:
            for name in own:
                link = os.path.join(tmp, self.CHECKPOINT_NAME, name)
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(os.path.join(folder, name), link)
            report(metrics, checkpoint=Checkpoint.from_directory(tmp))

    def _metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Every entry of `history` merged in order; only new entries are merged (a resumed Trainer
        loads a new history from its checkpoint: then from the start)."""
        if history is not self._history or len(history) < self._seen:
            self._history, self._merged, self._seen = history, {}, 0
        for entry in history[self._seen:]:
            self._merged.update(entry)
        self._seen = len(history)
        return dict(self._merged)


def _check_world(args: TrainingArguments, caller: str) -> None:
    """The Trainer must see this generation's world: Accelerate caches the world it first sees."""
    world = get_session(caller).context.get_world_size()
    if args.world_size != world:
        raise RuntimeError(
            f"the Trainer's TrainingArguments see a world of {args.world_size} process(es), but this generation has "
            f"{world}. Build TrainingArguments inside the training loop, in a module that imports "
            "elastic_train.huggingface (on CPU workers it sets ACCELERATE_USE_CPU, without which Accelerate trains "
            "each rank alone; or pass TrainingArguments(use_cpu=True)), and do not pass "
            "accelerator_config={'use_configured_state': True} with an Accelerate state made in an earlier generation."
        )


def _own_files(folder: str, args: TrainingArguments, state: TrainerState) -> list[str]:
    """The files of the checkpoint `folder` this process wrote, relative to it. With DDP the
    Trainer's process zero writes the model, optimizer, scheduler and trainer state, and every
    process writes its RNG state (`rng_state.pth` in a world of one)."""
    own_rng = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    names = []
    for root, _, files in os.walk(folder):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative == own_rng or (state.is_world_process_zero and not _RNG_STATE.fullmatch(relative)):
                names.append(relative)
    return sorted(names)


def prepare_trainer(trainer: Trainer, *, global_batch_size: int | None = None) -> Trainer:
    """Ready a `transformers.Trainer` for the run (Ray's `prepare_trainer`; Ray Data is not
    supported here). Call it in the loop, on every rank, before `trainer.train()`.

    It replaces the training DataLoader (Accelerate's, sharded by the world size) with one that
    deals each step's `global_batch_size` samples, split across the current ranks, from one
    seeded order per epoch (`data_seed`, else `seed`; sequential with
    `train_sampling_strategy="sequential"`). The step's global batch, hence the Trainer's steps per
    epoch and its learning-rate schedule, does not change when the world does: after a resize the
    Trainer's own resumption from a checkpoint skips exactly the samples its global step has seen
    (an index walk: no sample is loaded to be skipped), so within an epoch none is skipped or
    repeated, and the optimisation is that of a run at one size (up to float rounding).

    `global_batch_size`: samples per optimizer step across all workers. By default it is
    `per_device_train_batch_size * gradient_accumulation_steps * ` the run's largest world
    (`ScalingConfig` max `num_workers`): what the Trainer would take at full size. Below full size
    each worker's batches are larger by that ratio (mind GPU memory with a wide `num_workers`
    range). It must be a multiple of `gradient_accumulation_steps`.

    The Trainer's DataLoader is kept (with a warning: its position after a resize is then not
    exact) for an iterable or unsized dataset, a `train_sampling_strategy` other than "random" or
    "sequential", or a Trainer subclass that builds its own training DataLoader or sampler.
    `trainer.end()` finishes the trackers but leaves the process group, which is elastic_train's.
    """
    args = trainer.args
    _check_world(args, "prepare_trainer")
    if args.fsdp:
        raise ConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}) is not supported by prepare_trainer: under FSDP, Accelerate writes "
            "each rank's shards of a checkpoint, and this integration collects process zero's files as DDP writes "
            "them, so a resume would load a partial state. Train the Trainer with DDP (no fsdp), or shard a torch "
            "loop with elastic_train.torch.prepare_model(model, parallel_strategy='fsdp').")
    accumulation = args.gradient_accumulation_steps
    if global_batch_size is not None and (global_batch_size < 1 or global_batch_size % accumulation):
        raise ValueError(f"prepare_trainer(global_batch_size={global_batch_size!r}) must be a positive multiple of "
                         f"gradient_accumulation_steps={accumulation}.")
    if args.ignore_data_skip:
        logger.warning("TrainingArguments(ignore_data_skip=True): after a lost worker the resumed epoch starts over, "
                       "repeating the samples it had seen")
    if isinstance(trainer, _ElasticTrainer):
        trainer._elastic_global_batch_size = global_batch_size
        return trainer
    reason = _why_not_elastic(trainer)
    if reason is not None:
        logger.warning("prepare_trainer keeps the Trainer's own training DataLoader (%s): after a resize, the Trainer "
                       "resumes at a position counted in the new world's batches, so samples of the resumed epoch "
                       "may be skipped or repeated", reason)
    trainer.__class__ = _prepared_class(type(trainer))
    trainer._elastic_data = reason is None
    trainer._elastic_global_batch_size = global_batch_size
    return trainer


def _why_not_elastic(trainer: Trainer) -> str | None:
    """Why the training data cannot be dealt in world-size-independent global batches, if it cannot."""
    dataset, args = trainer.train_dataset, trainer.args
    if dataset is not None and not has_length(dataset):
        return "the training dataset has no length"
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        return f"train_sampling_strategy={strategy!r}"
    for method in ("get_train_dataloader", "_get_train_sampler"):
        if getattr(type(trainer), method) is not getattr(Trainer, method):
            return f"{type(trainer).__name__} overrides {method}"
    return None


class _ElasticTrainer:
    """What `prepare_trainer` adds to the user's Trainer class (see `_prepared_class`)."""

    _elastic_data: bool
    _elastic_global_batch_size: int | None

    def get_train_dataloader(self: Any) -> DataLoader:
        if not self._elastic_data:
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        args, dataset, collator = self.args, self.train_dataset, self.data_collator
        if _is_datasets_dataset(dataset):  # unused columns go as the Trainer removes them
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        context = get_context()
        sampler = _TrainerBatchSampler(
            len(dataset), self._elastic_step_batch() // args.gradient_accumulation_steps,
            context.get_world_rank(), context.get_world_size(),
            shuffle=getattr(args, "train_sampling_strategy", "random") != "sequential",
            seed=args.seed if args.data_seed is None else args.data_seed, drop_last=args.dataloader_drop_last,
        )
        return _EpochDataLoader(
            dataset, batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
        )

    def get_total_train_batch_size(self: Any, args: TrainingArguments) -> int:
        """The samples per optimizer step, for the Trainer's logs and throughput figures."""
        return self._elastic_step_batch() if self._elastic_data else super().get_total_train_batch_size(args)

    def _elastic_step_batch(self: Any) -> int:
        """Samples per optimizer step across all workers, whatever the world size."""
        if self._elastic_global_batch_size is not None:
            return self._elastic_global_batch_size
        largest = max(get_context().assignment.max_world_size, get_context().get_world_size())
        return self._train_batch_size * self.args.gradient_accumulation_steps * largest

    def end(self: Any) -> None:
        """Finish the trackers, as `Trainer.end()` does, but leave the process group: it is
        elastic_train's, rebuilt at every membership change (`Trainer.end()` destroys it)."""
        for tracker in self.accelerator.trackers:
            tracker.finish()


def _is_datasets_dataset(dataset: Any) -> bool:
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


@functools.cache
def _prepared_class(base: type) -> type:
    """`base` (the user's Trainer class) with `_ElasticTrainer`'s methods, as Ray's prepare_trainer
    subclasses it; made once per class."""
    return types.new_class(f"Elastic{base.__name__}", (_ElasticTrainer, base),
                           exec_body=lambda ns: ns.update({"__module__": base.__module__}))


class _TrainerBatchSampler(ElasticBatchSampler):
    """The Trainer counts the epochs and skips the batches of a resumed epoch itself (from its
    global step), so here `set_epoch` picks the epoch's order and every epoch is walked from its
    first global batch (the Trainer's skip wraps this sampler)."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _EpochDataLoader(DataLoader):
    """A DataLoader the Trainer tells the epoch (it calls `set_epoch` on its training DataLoader)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def __getattr__(name: str) -> Any:
    if name == "TransformersTrainer":  # where Ray 2.x before 2.7 also had it
        from elastic_train.huggingface.trainer import TransformersTrainer

        return TransformersTrainer
    return _unsupported(name)


_unsupported = unsupported_getattr("elastic_train.huggingface.transformers", "ray.train.huggingface.transformers", {
    "TransformersCheckpoint": (
        "Ray removed it (2.7): the reported elastic_train.Checkpoint holds RayTrainReportCallback.CHECKPOINT_NAME "
        "('checkpoint'), a folder that from_pretrained() loads: "
        "with checkpoint.as_directory() as d: model = AutoModel.from_pretrained(os.path.join(d, 'checkpoint'))."),
    "TransformersPredictor": "Ray removed it (2.7): load the checkpoint with from_pretrained in your own inference code.",
})

__all__ = ["RayTrainReportCallback", "prepare_trainer"]
