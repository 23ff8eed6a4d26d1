"""The benchmarks' workload as a Hugging Face Transformers loop, under elastic_train or Ray Train.

`train_loop(config)` has `benchmarks.common.train_loop`'s contract (config keys `api`, `log_dir`,
`kills`, `kill_every`, `steps`, `step_time`; one line per completed step in
`<log_dir>/progress.jsonl`, before the step is reported; rank 1 SIGKILLs itself on schedule),
written the way each system's Transformers guide has it: a `transformers.Trainer` with
`{api}.huggingface.transformers`'s `RayTrainReportCallback` and `prepare_trainer`, resumed with
`trainer.train(resume_from_checkpoint=...)` from `{api}.get_checkpoint()`. The Trainer saves a
checkpoint after every step (`save_steps=1`), and the callback reports it.

The model, its optimizer and a step's samples (32 per worker) are `benchmarks.common`'s; the
learning rate is constant, as there. Each rank has an `output_dir` of its own: Ray's callback
copies the newest checkpoint folder of `output_dir` on every rank, and in a folder shared by the
ranks of a machine it would copy rank 0's files while rank 0 is still writing them.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BATCH, kill_if_due, build_model

FEATURES = 64


def train_loop(config: dict[str, Any]) -> None:
    """The workload against `config["api"]` ("elastic_train" or "ray.train"); see the module's docstring."""
    from transformers import Trainer, TrainingArguments

    api = importlib.import_module(config["api"])
    integration = importlib.import_module(config["api"] + ".huggingface.transformers")
    rank = api.get_context().get_world_rank()
    workload = _workload(config["step_time"])
    args = TrainingArguments(
        output_dir=os.path.join(config["log_dir"], "hf_output", f"rank{rank}"), max_steps=config["steps"],
        per_device_train_batch_size=BATCH, lr_scheduler_type="constant", save_strategy="steps", save_steps=1,
        save_total_limit=1, logging_steps=1, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
        ddp_find_unused_parameters=False, use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=workload, args=args, train_dataset=_samples(), optimizers=(workload.optimizer, None),
                      callbacks=[_step_log(api, config), integration.RayTrainReportCallback()])
    trainer = integration.prepare_trainer(trainer)
    checkpoint = api.get_checkpoint()
    if checkpoint is None:
        trainer.train()
        return
    with checkpoint.as_directory() as d:
        trainer.train(resume_from_checkpoint=os.path.join(d, integration.RayTrainReportCallback.CHECKPOINT_NAME))


def _samples() -> list[dict[str, torch.Tensor]]:
    """64 steps' worth of samples for 2 workers (the Trainer walks as many epochs as `steps` needs)."""
    x = torch.randn(BATCH * 2 * 64, FEATURES, generator=torch.Generator().manual_seed(0))
    return [{"x": row} for row in x]


def _workload(step_time: float) -> torch.nn.Module:
    """benchmarks.common's model as a module the Trainer drives: it returns its loss, after
    `step_time` of simulated compute."""

    class Workload(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.optimizer = build_model()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = self.net(x).pow(2).mean()
            time.sleep(step_time)
            return {"loss": loss}

    return Workload()


def _step_log(api: Any, config: dict[str, Any]) -> Any:
    """Logs each completed step before it is saved and reported; on rank 1, kills the process when a
    kill is due."""
    from transformers import TrainerCallback

    log = Path(config["log_dir"])

    class StepLog(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.began = time.time()
            if api.get_context().get_world_rank() == 1 and config.get("kills"):
                kill_if_due(log, state.global_step + 1, config["kills"], config["kill_every"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            context = api.get_context()
            record = {"start": self.began, "time": time.time(), "pid": os.getpid(), "rank": context.get_world_rank(),
                      "world_size": context.get_world_size(), "step": state.global_step}
            with open(log / "progress.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    return StepLog()
