"""PyTorch Lightning on elastic_train: Ray Train's `ray.train.lightning` names, recovered in place.

`RayDDPStrategy`, `RayLightningEnvironment`, `RayTrainReportCallback` and `prepare_trainer` behave as
Ray's. What they add: the training DataLoader is re-sharded by `prepare_data_loader` (whose position
is recorded with every report), so after a resize `trainer.fit(ckpt_path=...)` goes on mid-epoch at
the new world size with no sample skipped or repeated; `RayTrainReportCallback(every_n_train_steps=N)`
reports mid-epoch; `RayDDPStrategy(global_batch_size=N)` keeps the step's global batch whatever the
world size.

Lightning ships as two packages, `lightning.pytorch` and `pytorch_lightning`, whose classes are
distinct: a Trainer of one rejects a strategy or plugin of the other. Ray subclasses
`lightning.pytorch` whenever it is installed; here each public class is built, when it is
instantiated, as a subclass of its counterpart in the package the calling code uses (see
`_ForLightning`), so both work in one environment and `isinstance(obj, RayDDPStrategy)` holds for both.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
import types
import warnings
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader, DistributedSampler

from elastic_train.api import get_context, report
from elastic_train.checkpoint import Checkpoint
from elastic_train.checkpoint.modes import CheckpointUploadMode
from elastic_train.errors import ConfigError
from elastic_train.torch.data import ElasticDataLoader, prepare_data_loader
from elastic_train.unsupported import unsupported_getattr
from elastic_train.worker.group.devices import get_device

logger = logging.getLogger(__name__)

# The two distributions of Lightning, by the top-level module names their classes live in.
_PACKAGE_OF_ROOT = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning",
                    "lightning_fabric": "pytorch_lightning"}
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")  # Ray's order of preference

if not any(importlib.util.find_spec(root) for root in ("lightning", "pytorch_lightning")):
    raise ModuleNotFoundError("PyTorch Lightning isn't installed. To install it, run 'pip install lightning'.")


# -- which Lightning -------------------------------------------------------------------------------
def _package_of(value: Any) -> str | None:
    """The Lightning package `value` (a module, class, function or instance) comes from, if any."""
    if isinstance(value, types.ModuleType):
        name = value.__name__
    elif isinstance(value, (type, types.FunctionType)):
        name = getattr(value, "__module__", None)
    else:
        name = type(value).__module__
    return _PACKAGE_OF_ROOT.get(name.partition(".")[0]) if isinstance(name, str) else None


def _packages_named(namespace: dict[str, Any]) -> set[str]:
    return {package for value in namespace.values() if (package := _package_of(value)) is not None}


def _package_for(caller: types.FrameType) -> types.ModuleType:
    """The Lightning package the code in `caller` works with: the one imported, when only one is;
    when both are, the one that the caller's variables (then its module's) refer to; else Ray's choice."""
    loaded = [sys.modules[name] for name in _PACKAGES if name in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    if not loaded:
        for name in _PACKAGES:
            if importlib.util.find_spec(name.partition(".")[0]) is not None:
                return importlib.import_module(name)
    for namespace in (caller.f_locals, caller.f_globals):
        named = _packages_named(namespace)
        if len(named) == 1:
            return sys.modules[named.pop()]
    logger.warning("both lightning.pytorch and pytorch_lightning are imported and %s refers to neither (or both): "
                   "using lightning.pytorch", caller.f_code.co_name)
    return sys.modules[_PACKAGES[0]]


class _ForLightning:
    """Base of the public classes. Instantiating one makes an instance of a class built (once per
    package) from it and its Lightning counterpart (`_counterpart`, a path in the package) of the
    package the calling code uses: the Trainer only accepts its own package's classes."""

    _counterpart: ClassVar[str]
    _package: ClassVar[str | None] = None  # set on the built classes

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        built = cls if cls._package else _built(cls, _package_for(sys._getframe(1)).__name__)
        return super(_ForLightning, built).__new__(built)


@functools.cache
def _built(cls: type, package: str) -> type:
    module, _, name = cls._counterpart.rpartition(".")
    counterpart = getattr(importlib.import_module(f"{package}.{module}"), name)
    return types.new_class(cls.__name__, (cls, counterpart), exec_body=lambda ns: ns.update(
        {"_package": package, "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}))


# -- the cluster environment ------------------------------------------------------------------------
class RayLightningEnvironment(_ForLightning):
    """Lightning's view of the world: the current generation's ranks and size (they change with
    every re-form, so they are read from the run's context, never cached)."""

    _counterpart = "plugins.environments.LightningEnvironment"

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the workers are Ray actors: Lightning must never launch processes itself

    def world_size(self) -> int:
        return get_context().get_world_size()

    def global_rank(self) -> int:
        return get_context().get_world_rank()

    def local_rank(self) -> int:
        return get_context().get_local_rank()

    def node_rank(self) -> int:
        return get_context().get_node_rank()

    def set_world_size(self, size: int) -> None:
        """Ignored: the world is the generation's."""

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the rank is the generation's."""

    def teardown(self) -> None:
        """Nothing to undo: the environment variables belong to the worker (Lightning's removes WORLD_SIZE)."""


# -- the strategy -----------------------------------------------------------------------------------
class RayDDPStrategy(_ForLightning):
    """Lightning's DDPStrategy on the run's process group (elastic_train creates and rebuilds it;
    Lightning never initializes or destroys it), with the training DataLoader made elastic.

    `global_batch_size`: samples per optimizer step across all workers, split among them, whatever
    the world size (then the optimisation does not depend on it). By default, as in Ray, each
    worker takes the DataLoader's `batch_size` per step. The arguments `process_group_backend`,
    `timeout` and `start_method` have no effect, as in Ray: see `elastic_train.torch.TorchConfig`.
    """

    _counterpart = "strategies.DDPStrategy"

    def __init__(self, *args: Any, global_batch_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.global_batch_size = global_batch_size
        self._train_loader: ElasticDataLoader | None = None

    @property
    def root_device(self) -> torch.device:
        return get_device()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader, which Lightning gave a DistributedSampler, is rebuilt over
        `prepare_data_loader`: one seeded order per epoch (the sampler's seed and shuffle), walked in
        global batches split across the ranks, its position recorded with every report."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = dataloader.sampler
        if not isinstance(sampler, DistributedSampler):  # Trainer(use_distributed_sampler=False): the loop shards
            logger.info("the training DataLoader has no DistributedSampler: left as it is, not resumed mid-epoch")
            return dataloader
        if type(sampler) is not DistributedSampler or dataloader.batch_size is None:
            raise ValueError(
                "RayDDPStrategy re-shards the training DataLoader at every world size, which it can do for "
                "DataLoader(dataset, batch_size=..., shuffle=True/False) only: a custom sampler or batch_sampler "
                f"({type(sampler).__name__}, batch_size={dataloader.batch_size}) has an order of its own. Use "
                "the default sampler, or Trainer(use_distributed_sampler=False) and shard in your DataLoader "
                "(then no sample-exact resume after a resize).")
        plain = DataLoader(
            dataloader.dataset, batch_size=dataloader.batch_size, shuffle=sampler.shuffle,
            drop_last=dataloader.drop_last, collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
            pin_memory=dataloader.pin_memory, worker_init_fn=dataloader.worker_init_fn,
            persistent_workers=dataloader.persistent_workers,
        )
        loader = prepare_data_loader(plain, move_to_device=False, global_batch_size=self.global_batch_size,
                                     seed=sampler.seed, resume_mid_epoch=True)  # Lightning moves batches itself
        # Lightning warns that a mid-epoch checkpoint is unsafe for a loader without state_dict(); this
        # one resumes from the position recorded with the checkpoint's report (not in the .ckpt, which
        # then loads in a plain Trainer too).
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
        if self._train_loader is not None:  # reload_dataloaders_every_n_epochs: a new loader for a new epoch
            loader.resume_from({"epoch": trainer.current_epoch, "position": 0})
        self._train_loader = loader
        return loader

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._train_loader is not None:
            _agree_on_position(self.lightning_module.trainer, self._train_loader)


def _batches_left(loader: ElasticDataLoader) -> int:
    """Steps the loader still yields in the epoch it resumes in."""
    sampler, position = loader.batch_sampler, loader.loader_state()["position"]
    full, rest = divmod(sampler.size - position, sampler.global_batch)
    return full + (1 if rest and not sampler.drop_last else 0)


def _agree_on_position(trainer: Any, loader: ElasticDataLoader) -> None:
    """Make Lightning's count of the epoch's batches agree with what the loader will still yield.

    Lightning ends an epoch by counting: the batches done (restored from the checkpoint) against
    `num_training_batches`. After a resize the loader goes on from the same sample, but in steps of
    another size when the global batch follows the world size, so the batches left differ from
    Lightning's count: the epoch's counters are set so that Lightning's count of the batches left is
    the loader's. Runs before the epoch loop's own reset (`on_train_start`), which derives its
    counters from these (`reset_on_restart`); `current` only: `total` keeps counting real steps.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress
    batches = trainer.num_training_batches
    restarting, after_batch = epoch_loop.restarting, epoch_loop.restarted_on_train_batch_end
    mid_epoch = restarting and not progress.is_last_batch
    done = progress.current.completed + int(after_batch) if mid_epoch else 0
    state, epoch = loader.loader_state(), trainer.current_epoch
    if (state == {"epoch": 0, "position": 0} and (epoch, done) != (0, 0)) or (
            mid_epoch and (state["epoch"], state["position"] > 0) != (epoch, done > 0)):
        # A checkpoint whose position this run did not record (resume_from_checkpoint, a checkpoint of
        # another run, a reloaded DataLoader): Lightning's count, in today's global batches.
        position = min(loader.batch_sampler.size, done * loader.batch_sampler.global_batch)
        logger.warning("the checkpoint's position in the epoch was not recorded by this run: resuming epoch %d at "
                       "sample %d (exact if the global batch is the one it was saved with)",
                       epoch, position)
        loader.resume_from({"epoch": epoch, "position": position})
    elif not mid_epoch and state["position"] > 0:
        # Lightning starts an epoch, so does the loader: the one it saved in was cut short (limit_train_batches)
        # or left a tail smaller than a batch (drop_last).
        loader.resume_from({"epoch": state["epoch"] + 1, "position": 0})
    if mid_epoch:
        shift = max(0, batches - _batches_left(loader)) - done
    elif restarting and after_batch:  # saved after the epoch's last batch: let Lightning see it at any size
        shift = max(0, batches - 1 - progress.current.completed)
    else:
        return
    current = progress.current
    current.ready, current.started = current.ready + shift, current.started + shift
    current.processed, current.completed = current.processed + shift, current.completed + shift


# -- prepare_trainer ----------------------------------------------------------------------------------
def prepare_trainer(trainer: Any) -> Any:
    """Check that the Trainer runs on elastic_train (as Ray's does): its strategy is RayDDPStrategy
    and its cluster environment RayLightningEnvironment."""
    if not isinstance(trainer.strategy, RayDDPStrategy):
        raise RuntimeError(
            f"Invalid strategy class: {type(trainer.strategy)}. To use PyTorch Lightning with elastic_train, the "
            "strategy object should be elastic_train.lightning.RayDDPStrategy or a subclass of it.")
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, RayLightningEnvironment):
        raise RuntimeError("Invalid cluster environment plugin. The expected class is "
                           f"elastic_train.lightning.RayLightningEnvironment but got {type(environment)}!")
    return trainer


# -- the report callback -------------------------------------------------------------------------------
class RayTrainReportCallback(_ForLightning):
    """Reports `trainer.callback_metrics` (as floats) plus `epoch` and `step`, with a checkpoint
    holding `checkpoint.ckpt` (Lightning's, written by global rank 0 as Lightning does), at the end
    of every training epoch, as Ray's does.

    `every_n_train_steps=N`: also report every N optimizer steps, mid-epoch, so that a lost worker
    costs at most N steps: the loop resumes from the step reported last, mid-epoch. An epoch's last
    step is reported at the epoch's end (after its validation), once. `checkpoint_upload_mode`:
    ASYNC (elastic_train's default) or SYNC, see `elastic_train.report`.
    """

    _counterpart = "callbacks.Callback"
    CHECKPOINT_NAME = "checkpoint.ckpt"

    def __init__(self, checkpoint_upload_mode: CheckpointUploadMode | None = None, validation: bool = False,
                 every_n_train_steps: int | None = None) -> None:
        super().__init__()
        if validation:
            raise NotImplementedError(
                "RayTrainReportCallback(validation=...) is not supported by elastic_train: validate in "
                "LightningModule.validation_step (its metrics are reported) or after fit() on result.best_checkpoints.")
        if checkpoint_upload_mode is CheckpointUploadMode.NO_UPLOAD:
            raise ValueError("RayTrainReportCallback writes its checkpoint to a local folder: use ASYNC or SYNC.")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps={every_n_train_steps!r} must be a positive number of steps.")
        self.checkpoint_upload_mode = checkpoint_upload_mode
        self.every_n_train_steps = every_n_train_steps
        self._reported_step = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._reported_step = trainer.global_step  # a resumed run: its checkpoint's step is reported already

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        every, step = self.every_n_train_steps, trainer.global_step
        # step != the one reported last: an optimizer step was taken (not a batch of gradient accumulation)
        if every is not None and step != self._reported_step and step % every == 0 and not trainer.is_last_batch:
            self._report(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # With every_n_train_steps, training may have stopped (max_steps) right after a report.
        if self.every_n_train_steps is None or trainer.global_step != self._reported_step:
            self._report(trainer)

    def _report(self, trainer: Any) -> None:
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
        with tempfile.TemporaryDirectory(prefix="elastic_train_lightning_") as folder:
            # Trainer.save_checkpoint() without its barrier: report() is one. Every rank dumps (a
            # sharded strategy gathers there); the strategy decides who writes (rank 0 for DDP).
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            trainer.strategy.save_checkpoint(checkpoint, os.path.join(folder, self.CHECKPOINT_NAME))
            written = Checkpoint.from_directory(folder) if os.listdir(folder) else None
            report(metrics, checkpoint=written, checkpoint_upload_mode=self.checkpoint_upload_mode,
                   delete_local_checkpoint_after_upload=False)  # the folder is removed here, once held
        self._reported_step = trainer.global_step


class RayFSDPStrategy(_ForLightning):
    """Ray's FSDP strategy, taken so that code naming it runs (Ray's own tests build one beside
    RayDDPStrategy whichever they use), and refused when a Trainer sets it up."""

    _counterpart = "strategies.FSDPStrategy"

    def setup_environment(self) -> None:
        raise ConfigError(
            "RayFSDPStrategy is not supported: torch's FullyShardedDataParallel refuses CPU devices (\"FSDP needs a "
            "non-CPU accelerator device\"), so it cannot run on the gloo workers this integration is built and "
            "tested on. Use RayDDPStrategy (add global_batch_size=... for world-size-independent steps).")


class RayDeepSpeedStrategy:
    """Ray's DeepSpeed strategy, named so that code importing it beside RayDDPStrategy runs, and refused
    when one is built."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise ConfigError(
            "RayDeepSpeedStrategy is not supported: DeepSpeed's ZeRO checkpoints are partitioned by world size, so "
            "a run cannot resume in place at another size from them, and DeepSpeed is not installed with "
            "elastic_train. Use RayDDPStrategy.")


_UNSUPPORTED = {
    **dict.fromkeys(("LightningTrainer", "LightningConfigBuilder"), (
        "Ray removed it (2.7): build a lightning Trainer inside the loop with strategy=RayDDPStrategy(), "
        "plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()], pass it through "
        "prepare_trainer, and run the loop with elastic_train.torch.TorchTrainer.")),
    "LightningCheckpoint": (
        "Ray removed it (2.7): the reported elastic_train.Checkpoint holds RayTrainReportCallback.CHECKPOINT_NAME "
        "('checkpoint.ckpt'); open it with checkpoint.as_directory() and pass that file to "
        "LightningModule.load_from_checkpoint or trainer.fit(ckpt_path=...)."),
    "LightningPredictor": "Ray removed it (2.7): load the checkpoint in your own inference code.",
}
__getattr__ = unsupported_getattr("elastic_train.lightning", "ray.train.lightning", _UNSUPPORTED)

__all__ = ["RayDDPStrategy", "RayFSDPStrategy", "RayDeepSpeedStrategy", "RayLightningEnvironment",
           "RayTrainReportCallback", "prepare_trainer"]
