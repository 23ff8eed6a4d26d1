"""The benchmarks' workload as a PyTorch Lightning loop, under elastic_train or Ray Train.

`train_loop(config)` has `benchmarks.common.train_loop`'s contract (config keys `api`, `log_dir`,
`kills`, `kill_every`, `steps`, `step_time`; one line per completed step in
`<log_dir>/progress.jsonl`; rank 1 SIGKILLs itself on schedule), written the way each system's
Lightning guide has it: `{api}.lightning`'s strategy, environment, `prepare_trainer` and
`RayTrainReportCallback`, resumed with `trainer.fit(ckpt_path=...)` from `{api}.get_checkpoint()`.

Both systems report a checkpoint (Lightning's `checkpoint.ckpt`, written by rank 0) after every
step with their stock callback: an epoch is one step (`limit_train_batches=1`), and Ray's callback
reports at every epoch's end. elastic_train's is asked for `every_n_train_steps=1`, which reports
the same steps (an epoch's last step is reported at its end).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import BATCH, kill_if_due, build_model



def train_loop(config: dict[str, Any]) -> None:
    """The workload against `config["api"]` ("elastic_train" or "ray.train"); see the module's docstring."""
    import lightning.pytorch as pl

    api = importlib.import_module(config["api"])
    integration = importlib.import_module(config["api"] + ".lightning")
    every_step = {"every_n_train_steps": 1} if config["api"] == "elastic_train" else {}
    trainer = pl.Trainer(
        max_epochs=config["steps"], limit_train_batches=1, strategy=integration.RayDDPStrategy(),
        plugins=[integration.RayLightningEnvironment()], accelerator="cpu", devices="auto",
        callbacks=[_step_log(pl, api, config), integration.RayTrainReportCallback(**every_step)],
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=config["log_dir"],
    )
    trainer = integration.prepare_trainer(trainer)
    model, data = _module(pl, config["step_time"]), _data()
    checkpoint = api.get_checkpoint()
    if checkpoint is None:
        trainer.fit(model, train_dataloaders=data)
        return
    with checkpoint.as_directory() as d:
        trainer.fit(model, train_dataloaders=data,
                    ckpt_path=os.path.join(d, integration.RayTrainReportCallback.CHECKPOINT_NAME))


def _data() -> DataLoader:
    samples = torch.randn(BATCH * 64, 64, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(samples), batch_size=BATCH, shuffle=True)


def _module(pl: Any, step_time: float) -> Any:
    """benchmarks.common's model, optimizer and step as a LightningModule."""

    class Workload(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self._optimizer = build_model()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net(batch[0]).pow(2).mean()
            time.sleep(step_time)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return self._optimizer

    return Workload()


def _step_log(pl: Any, api: Any, config: dict[str, Any]) -> Any:
    """Logs each completed step before it is reported; on rank 1, kills the process when a kill is due."""
    log = Path(config["log_dir"])

    class StepLog(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.began = time.time()
            if trainer.global_rank == 1 and config.get("kills"):
                kill_if_due(log, trainer.global_step + 1, config["kills"], config["kill_every"])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            record = {"start": self.began, "time": time.time(), "pid": os.getpid(), "rank": trainer.global_rank,
                      "world_size": api.get_context().get_world_size(), "step": trainer.global_step}
            with open(log / "progress.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    return StepLog()
