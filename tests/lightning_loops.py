"""Lightning loops for tests/test_lightning.py: the seed's pattern run on workers, and the same model
trained in one process without Ray (the fault-free reference).

Lightning is imported inside the functions, by the package name in the config: a worker then has
one Lightning package loaded, as a user's would (lightning.pytorch or pytorch_lightning).
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_train.torch.data import ElasticBatchSampler
from tests.loops import fault_once, log_progress

SAMPLES, FEATURES = 96, 8
QUIET = {"enable_progress_bar": False, "enable_model_summary": False}


def regression_data() -> TensorDataset:
    """(sample id, x, y): a noisy linear target, the same in every process."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(torch.arange(SAMPLES), x, y)


@functools.cache
def lightning_classes(package: str) -> tuple[type, type]:
    """The LightningModule and LightningDataModule of the tests, for `package`'s Lightning."""
    pl = importlib.import_module(package)

    class Regression(pl.LightningModule):
        """A small MLP; in a run (config["log_dir"]), each step logs its samples and may inject a fault."""

        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.config = config

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, x, y = batch
            if self.config.get("log_dir"):
                _observe_step(self.config, self.global_step + 1, self.current_epoch, ids)
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            time.sleep(self.config.get("step_time", 0.0))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            _, x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class RegressionData(pl.LightningDataModule):
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__()
            self.config = config

        def train_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(), batch_size=self.config["batch_size"], shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(regression_data(), batch_size=32)

    return Regression, RegressionData


def _observe_step(config: dict[str, Any], step: int, epoch: int, ids: torch.Tensor) -> None:
    import ray

    import elastic_train

    ctx = elastic_train.get_context()
    fault_once(config, step, ctx.get_world_rank())
    log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                 generation=ctx.get_generation(), step=step, epoch=epoch, ids=ids.tolist(),
                 node=ray.get_runtime_context().get_node_id())


def seed_loop(config: dict[str, Any]) -> None:
    """The seed's pattern (`ray.train` -> `elastic_train` in its imports); config["strategy"] and
    config["report"] are the keyword arguments of RayDDPStrategy and RayTrainReportCallback."""
    import elastic_train
    from elastic_train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    pl = importlib.import_module(config["lightning"])
    module_class, data_class = lightning_classes(config["lightning"])
    model, datamodule = module_class(config), data_class(config)
    trainer = pl.Trainer(max_epochs=config["epochs"], strategy=RayDDPStrategy(**config.get("strategy", {})),
                         plugins=[RayLightningEnvironment()], accelerator="auto", devices="auto",
                         callbacks=[RayTrainReportCallback(**config.get("report", {}))], enable_checkpointing=False,
                         default_root_dir=config["log_dir"], **QUIET)
    trainer = prepare_trainer(trainer)
    checkpoint = elastic_train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            trainer.fit(model, datamodule=datamodule,
                        ckpt_path=os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.fit(model, datamodule=datamodule)


def seed_as_written(config: dict[str, Any]) -> None:
    """Seed 002's Lightning loop word for word (`ray.train` -> `elastic_train` in its imports): no
    report callback, Lightning's default checkpointing and logger. Then it notes where it ran."""
    from elastic_train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    import lightning.pytorch as pl

    MyLightningModule, MyDataModule = lightning_classes("lightning.pytorch")

    model = MyLightningModule(config)
    datamodule = MyDataModule(config)
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        accelerator="auto",
        devices="auto",
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, datamodule=datamodule)
    log_progress(config["notes"], rank=trainer.global_rank, world=trainer.world_size, step=trainer.global_step,
                 cwd=os.getcwd())


class _EpochOrder(ElasticBatchSampler):
    """The elastic loader's global batches on one process: a DataLoader iterates its batch sampler
    once per epoch, and so does Lightning the DataLoader."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epochs = 0

    def __iter__(self) -> Any:
        self.epoch, self._epochs = self._epochs, self._epochs + 1
        return super().__iter__()


def reference_state(epochs: int, global_batch: int) -> dict[str, torch.Tensor]:
    """The model after `epochs` in one process, without Ray, on the global batches a run takes at any
    world size (same order, same seed 0). DDP averages the ranks' mean gradients, which equals the
    global batch's mean gradient when every rank's share is the same size: so a run whose global
    batch splits evenly over its ranks follows this trajectory, up to float rounding."""
    import lightning.pytorch as pl

    module_class, _ = lightning_classes("lightning.pytorch")
    model = module_class({})
    sampler = _EpochOrder(SAMPLES, global_batch, 0, 1, shuffle=True, seed=0, drop_last=False)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         **QUIET)
    trainer.fit(model, train_dataloaders=DataLoader(regression_data(), batch_sampler=sampler))
    return model.state_dict()
