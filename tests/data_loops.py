"""Training loops fed by Ray Data (`TorchTrainer(datasets=...)`, `get_dataset_shard`), as Ray Train's
guides write them, for the tests that kill and resize their runs."""

from __future__ import annotations

import time

import torch

import elastic_train as et
from tests.loops import fault_once, log_progress


def dataset_counting_loop(config: dict) -> None:
    """Counts, in replicated state, how often each row of the "train" dataset (ids 0..rows-1, in its
    "id" column) was trained; checkpointed every step by every rank alike. After E clean epochs every
    count is E: a row skipped or repeated in an epoch (across kills and resizes) shows."""
    import torch.distributed as dist

    n, epochs = config["rows"], config["epochs"]
    counts, step, first_epoch = torch.zeros(n), 0, 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        counts, step, first_epoch = state["counts"], state["step"], state["epoch"]
    ctx = et.get_context()
    for epoch in range(first_epoch, epochs):
        shard = et.get_dataset_shard("train")
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=torch.long):
            step += 1
            fault_once(config, step, ctx.get_world_rank())
            delta = torch.zeros(n).index_add_(0, batch["id"], torch.ones(len(batch["id"])))
            dist.all_reduce(delta)
            counts += delta
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                         generation=ctx.get_generation(), step=step, epoch=epoch, batch=batch["id"].tolist())
            time.sleep(config.get("step_time", 0.0))
            et.report({"step": step, "epoch": epoch},
                      checkpoint=et.Checkpoint.from_dict({"counts": counts, "epoch": epoch, "step": step}))
