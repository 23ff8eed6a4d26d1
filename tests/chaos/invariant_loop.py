"""The loop every chaos scenario runs: small, deterministic, and checkable after any faults.

* The math does not depend on the world size: a global batch of `global_batch` samples per step is
  split over the ranks, each rank's loss is its samples' summed loss x world / global_batch, so the
  DDP gradient average is the global batch's mean at any world size. Fixed seeds: a fault-free run
  and a run through any faults end with the same parameters (up to float rounding).
* Each step, every rank counts the samples of its share; counts are all-reduced and checkpointed.
  After E epochs every count is E: a sample skipped or repeated within an epoch shows.
* Each rank logs every completed step (pid, rank, world, generation) before `report()`, so steps
  redone per fault can be counted.
* With `live_state`, the loop reports no checkpoint: the model (its buffer holds the counts) and the
  optimizer are kept live by `prepare_model(model, live_state=True)`, the loop goes on from the
  loader's epoch and the resumed report index, and rank 0 returns its final state (Result.return_value).
  The step's collectives come before `optimizer.step()`, so a failure never lands between a state
  written and the report that holds it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler

import elastic_train as et
from elastic_train.torch import prepare_data_loader, prepare_model
from tests.loops import fault_once, log_progress

SAMPLES, FEATURES = 96, 4


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def invariant_loop(config: dict) -> dict | None:
    epochs, global_batch, live = config["epochs"], config["global_batch"], config.get("live_state", False)
    ctx = et.get_context()
    fault_once(config, ctx.get_resume_index(), ctx.get_world_rank(), point="start", generation=ctx.get_generation())
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=config.get("momentum", 0.0))
    counts, step = torch.zeros(SAMPLES), ctx.get_resume_index()
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        counts, step = state["counts"], state["step"]
    if live:
        model.register_buffer("counts", counts)
    ddp = prepare_model(model, live_state=live)  # DDP's defaults: rank 0's buffers broadcast at every forward
    counts = model.counts if live else counts  # restored with the model
    x, y = dataset()
    ids = torch.arange(SAMPLES)
    loader = prepare_data_loader(DataLoader(ids, batch_size=global_batch, sampler=RandomSampler(ids)),
                                 global_batch_size=global_batch, seed=7,
                                 resume_mid_epoch=True)  # a checkpoint every step, no fast-forward of its own
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start_epoch = loader.epoch  # where a resumed loader goes on
    for epoch in range(start_epoch, epochs):
        for batch in loader:
            step += 1
            fault_once(config, step, rank, generation=ctx.get_generation())
            loss = torch.nn.functional.mse_loss(ddp(x[batch]), y[batch], reduction="sum") * world / global_batch
            optimizer.zero_grad()
            loss.backward()
            delta = torch.zeros(SAMPLES)
            delta[batch] += 1
            dist.all_reduce(delta)
            optimizer.step()
            counts += delta
            time.sleep(config.get("step_time", 0.0))
            log_progress(config["log_dir"], rank=rank, world=world, generation=ctx.get_generation(), step=step,
                         epoch=epoch)
            fault_once(config, step, rank, point="before_report", generation=ctx.get_generation())
            checkpoint = None if live else et.Checkpoint.from_dict(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counts": counts, "step": step})
            et.report({"step": step, "epoch": epoch, "loss": loss.item()}, checkpoint=checkpoint)
    while world < config.get("end_at_world", 0):  # a run that must end grown waits for its growth
        time.sleep(config.get("step_time", 0.0))  # reporting: the supervisor unwinds the loop at a report
        et.report({"step": step, "epoch": epochs - 1, "waiting_for_world": config["end_at_world"]})
    return {"model": model.state_dict(), "counts": counts, "step": step} if live else None


def reference_params(epochs: int, global_batch: int, momentum: float = 0.0) -> dict[str, torch.Tensor]:
    """The parameters a fault-free run ends with: the same math in one process, no runtime."""
    from elastic_train.torch.data import ElasticBatchSampler

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    x, y = dataset()
    sampler = ElasticBatchSampler(SAMPLES, global_batch, rank=0, world_size=1, shuffle=True, seed=7, drop_last=False)
    for epoch in range(epochs):
        sampler.epoch = epoch
        for chunk in sampler.chunks():
            batch = torch.tensor(chunk)
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch], reduction="sum") / global_batch
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()
