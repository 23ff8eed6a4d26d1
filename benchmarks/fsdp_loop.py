"""The benchmarks' workload sharded with FSDP2 (`benchmarks.kill_recovery --parallel fsdp`).

The same MLP as benchmarks/common.py, AdamW, batches from `prepare_data_loader`, written once for
both APIs. elastic_train: `prepare_model(model, parallel_strategy="fsdp", live_state=True)`: its state
is kept between the loop's checkpoints, and a recovery re-shards it from the survivors' memory.
Ray Train 2.60's `prepare_model(parallel_strategy="fsdp")` wraps FSDP1, which refuses CPU devices, so
under Ray Train the loop shards the model itself, as Ray's FSDP2 guide does. Every `checkpoint_every`
steps every rank saves its shards with DCP and reports them (Ray's guide); a restart loads them at
the new world size.

Each rank logs, per generation, `prepared_s`: the time from entering the loop to a model sharded
and restored (FSDP2 at the new world, and the state re-sharded into it or loaded from storage); and
per step, `report_s`: the time `report()` took (for a kept sharded state, the copy of the rank's share).
An elastic_train worker's log (Ray's worker-*.err) says what it holds in memory each time it parks:
reports of its own, and of its peer's shares (MB).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.common import WIDTH, train_step, workload_steps

FSDP_WIDTH = 896  # 4 x Linear(896, 896): 3.2 M parameters, 38 MB with AdamW's two moments


def _log_parks() -> None:
    """This worker's log says what it holds as it parks (elastic_train.worker.member, at INFO)."""
    logger = logging.getLogger("elastic_train.worker.member")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def train_loop(config: dict[str, Any]) -> None:
    api = importlib.import_module(config["api"])
    api_torch = importlib.import_module(config["api"] + ".torch")
    context = api.get_context()
    log = Path(config["log_dir"])
    entered = time.time()
    width = config.get("width", WIDTH)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(layer for _ in range(4) for layer in (torch.nn.Linear(width, width), torch.nn.ReLU())))
    every = config.get("checkpoint_every", 1)
    kept = config["api"] == "elastic_train"  # its state kept between the loop's checkpoints
    if config["api"] == "elastic_train":
        _log_parks()
        model = api_torch.prepare_model(model, parallel_strategy="fsdp", live_state=True)
    else:
        mesh = init_device_mesh("cpu", (context.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = context.get_resume_index() + 1 if kept else 1
    checkpoint = api.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=d)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            start = json.loads(Path(d, "step.json").read_text())["step"] + 1
    prepared = time.time() - entered
    first = True
    for step, inputs, _ in workload_steps(api_torch, context, config, start, width):
        rank = context.get_world_rank()
        began = time.time()
        loss = train_step(model, optimizer, inputs, config["step_time"])
        record = {"start": began, "time": time.time(), "pid": os.getpid(), "rank": rank,
                  "world_size": context.get_world_size(), "step": step, **({"prepared_s": prepared} if first else {})}
        first = False
        reporting = time.time()
        metrics = {"loss": loss.item(), "step": step}
        if every > 0 and (step % every == 0 or step == config["steps"]):
            with tempfile.TemporaryDirectory() as d:
                model_state, optim_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=d)
                if rank == 0:
                    Path(d, "step.json").write_text(json.dumps({"step": step}))
                api.report(metrics, checkpoint=api.Checkpoint.from_directory(d))
        else:
            api.report(metrics)
        record["report_s"] = time.time() - reporting
        with open(log / "progress.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
