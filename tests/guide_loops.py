"""Loops written as Ray Train's guides write them, and the replay that checks where they end.

`guide_loop`: a model prepared with `prepare_model`, data from `prepare_data_loader` (batch size per
worker, as the guides give it), or with `data="ray"` from the "train" dataset's shard
(`get_dataset_shard`, `iter_torch_batches`; `ray_dataset()`), the mean loss, `loss.backward()`, `optimizer.step()`; rank 0 alone
saves model (through `model.module`), optimizer and epoch at the end of each epoch (or every
`checkpoint_every` steps) and every rank reports; a resumed loop goes on from the checkpoint's epoch.
No state kept live. Options: a BatchNorm layer (DDP broadcasts rank 0's buffers before each forward),
a layer no step uses (`find_unused_parameters=True`), gradient accumulation over `accumulate` batches
(`no_sync` for all but the last; every epoch's batch count a multiple of it), a report of metrics
alone after each step (`report_every_step`), the loss all-reduced over the ranks after each step
(`all_reduce_loss`, a metric as the guides average it), AMP's `GradScaler` (`amp`). Every rank logs each step it completed: its epoch, its step within the epoch, its
generation, rank, world size and the sample ids of each batch of the step; and, before the step's
last backward, the batches it drew.

`replay`: the parameters a correct run ends with, recomputed in this process from what the ranks
logged: each step's gradient is the mean of the ranks' gradients that completed it (DDP's average over
the group that reduced it), a step redone after a re-entry counts once (its latest computation), so
it is a fault-free run that follows the world-size schedule the run took.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import elastic_train as et
from elastic_train.torch import prepare_data_loader, prepare_model
from tests.loops import fault_once, log_progress, read_progress

SAMPLES, FEATURES = 64, 4
LR, MOMENTUM = 0.05, 0.9


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1 * torch.randn(
        SAMPLES, 1, generator=g, dtype=torch.float64)
    return x, y


class Net(torch.nn.Module):
    def __init__(self, batch_norm: bool, unused: bool):
        super().__init__()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(FEATURES, 8)] + ([torch.nn.BatchNorm1d(8)] if batch_norm else [])
        self.body = torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.unused = torch.nn.Linear(8, 1) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def ray_dataset() -> Any:
    """The sample ids as a Ray Data dataset ("id"), shuffled (seeded) and through a `map_batches`."""
    import ray.data

    return ray.data.range(SAMPLES, override_num_blocks=5).random_shuffle(seed=7).map_batches(lambda b: b)


def new_model(config: dict) -> torch.nn.Module:
    return Net(config.get("batch_norm", False), config.get("unused", False)).double()


def new_optimizer(model: torch.nn.Module, config: dict) -> torch.optim.Optimizer:
    """SGD with momentum; `config["lr"]` a smaller rate for long runs (at LR, hundreds of epochs at a
    batch of 4 swing wide enough to grow the last bit a reduction's order leaves into a visible one)."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", LR), momentum=MOMENTUM)


def guide_loop(config: dict) -> None:
    """config: epochs, step_time, fault (tests/loops.py `fault_once`, `at_step` = epoch * 100 + step, or
    epoch * 100 + 99 for the epoch's report),
    log_dir; checkpoint_every (steps; default: once an epoch)."""
    import time

    model = prepare_model(new_model(config), parallel_strategy_kwargs={"find_unused_parameters": True}
                          if config.get("unused") else None)
    optimizer = new_optimizer(model, config)
    scaler = torch.amp.GradScaler("cpu", enabled=config.get("amp", False))
    start_epoch = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    x, y = dataset()
    if config.get("data") == "ray":
        loader = et.get_dataset_shard("train").iter_torch_batches(batch_size=4)
    else:
        loader = prepare_data_loader(DataLoader(torch.arange(SAMPLES), batch_size=4, shuffle=True))
    every = config.get("checkpoint_every")
    for epoch in range(start_epoch, config["epochs"]):
        if epoch >= planned_epochs(config):
            break
        if et.get_context().get_world_size() > 1 and hasattr(loader, "sampler"):
            loader.sampler.set_epoch(epoch)
        step, drawn = 0, []
        for batch in loader:
            batch = batch["id"] if isinstance(batch, dict) else batch
            point = epoch * 100 + step
            fault_once(config, point, et.get_context().get_world_rank())
            drawn.append(batch.tolist())
            last = len(drawn) == config.get("accumulate", 1)
            if last:  # what the step trains, should this rank be lost once it reduced its gradients (completed_steps)
                ctx = et.get_context()
                log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                             generation=ctx.get_generation(), epoch=epoch, step=step, drawn=drawn)
            with contextlib.nullcontext() if last else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
                scaler.scale(loss).backward()
            if not last:
                continue
            ctx = et.get_context()  # the step's gradients are reduced: its batches count
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                         generation=ctx.get_generation(), epoch=epoch, step=step, batches=drawn, loss=loss.item())
            fault_once(config, point, ctx.get_world_rank(), point="before_step")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            fault_once(config, point, ctx.get_world_rank(), point="after_step")
            if config.get("all_reduce_loss"):
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                loss = mean_loss / et.get_context().get_world_size()  # what the reports carry
            time.sleep(config.get("step_time", 0.0))
            step, drawn = step + 1, []
            if config.get("report_every_step"):  # metrics alone
                et.report({"epoch": epoch, "step": step, "loss": loss.item()})
            if every and step % every == 0:
                _report(model, optimizer, epoch, {"epoch": epoch, "step": step, "loss": loss.item()}, config, point,
                        last=False)
        if not every:  # the epoch's report: fault point epoch * 100 + 99, whatever its steps
            _report(model, optimizer, epoch, {"epoch": epoch, "loss": loss.item()}, config, epoch * 100 + 99,
                    last=True)


def planned_epochs(config: dict) -> int:
    """config["epochs"], or the number a test wrote to log_dir/epochs to end the run sooner (written
    once, ahead of every rank's epoch: every rank reads the same answer where it matters)."""
    path = os.path.join(config["log_dir"], "epochs")
    return int(open(path).read()) if os.path.exists(path) else config["epochs"]


def _report(model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, metrics: dict, config: dict,
            point: int, last: bool) -> None:
    """Rank 0 alone saves; every rank reports (faults: "saving", rank 0 in the middle of its save;
    "report", as the rank calls report()). A checkpoint in mid-epoch resumes that epoch afresh: `epoch`
    is the last one done."""
    rank = et.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch if last else epoch - 1}
            torch.save(state["model"], os.path.join(d, "weights.pt"))
            fault_once(config, point, rank, point="saving")
            torch.save(state, os.path.join(d, "model.pt"))
            checkpoint = et.Checkpoint.from_directory(d)
        fault_once(config, point, rank, point="report")
        et.report(metrics, checkpoint=checkpoint)


def completed_steps(log_dir: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Each step of the run's lineage, by (epoch, step): the ranks' records of it. A generation's
    first step supersedes the older generations' records from that step on: a loop entered afresh
    from a checkpoint did them again (a loop that went on in place had none there). A rank lost after
    its gradients were reduced but before it logged the step counts in it with the batches it drew,
    where a peer of its generation completed the step (that reduction held every rank's gradients)."""
    logged = read_progress(log_dir)
    records = [p for p in logged if "batches" in p]
    done = {(p["pid"], p["generation"], p["epoch"], p["step"]) for p in records}
    finished = {(p["generation"], p["epoch"], p["step"]) for p in records}
    records += [{**p, "batches": p["drawn"]} for p in logged if "drawn" in p
                and (p["pid"], p["generation"], p["epoch"], p["step"]) not in done
                and (p["generation"], p["epoch"], p["step"]) in finished]
    steps: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for generation in sorted({p["generation"] for p in records}):
        mine = [p for p in records if p["generation"] == generation]
        first = min((p["epoch"], p["step"]) for p in mine)
        steps = {key: kept for key, kept in steps.items() if key < first}
        for p in mine:
            steps.setdefault((p["epoch"], p["step"]), []).append(p)
    return steps


def replay(log_dir: str, config: dict) -> dict[str, torch.Tensor]:
    """The state of a fault-free run through the steps the ranks logged (see the module's docstring):
    a step's gradient is the mean over its ranks of each one's gradients summed over its batches;
    the buffers (BatchNorm's) are rank 0's, which DDP broadcasts before each forward. A rank logs a
step once its gradients are reduced: a rank lost after that counts in it."""
    model, (x, y) = new_model(config), dataset()
    optimizer = new_optimizer(model, config)
    for _, records in sorted(completed_steps(log_dir).items()):
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        grads = []
        for record in sorted(records, key=lambda r: r["rank"], reverse=True):  # rank 0's forwards last
            model.load_state_dict(buffers, strict=False)
            model.zero_grad()
            for batch in record["batches"]:
                torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        for p, *rank_grads in zip(model.parameters(), *grads):
            p.grad = None if rank_grads[0] is None else torch.stack(rank_grads).mean(dim=0)
        optimizer.step()
    return model.state_dict()


def final_state(result: et.Result) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "model.pt"), weights_only=True)["model"]
