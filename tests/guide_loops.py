"""Loops written as Ray Train's guides write them, and the replay that checks where they end.

`guide_loop`: a model prepared with `prepare_model`, data from `prepare_data_loader` (batch size per
worker, as the guides give it), the mean loss, `loss.backward()`, `optimizer.step()`; rank 0 alone
saves model (through `model.module`), optimizer and epoch at the end of each epoch (or every
`checkpoint_every` steps) and every rank reports; a resumed loop goes on from the checkpoint's epoch.
No state kept live. Every rank logs each step it completed: its epoch, its step within the epoch, its
generation, rank, world size and the batch's sample ids.

`replay`: the parameters a correct run ends with, recomputed in this process from what the ranks
logged: each step's gradient is the mean of the ranks' gradients that completed it (DDP's average over
the group that reduced it), a step redone after a re-entry counts once (its latest computation), so
it is a fault-free run that follows the world-size schedule the run took.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
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


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def guide_loop(config: dict) -> None:
    """config: epochs, step_time, fault (tests/loops.py `fault_once`, `at_step` = epoch * 100 + step),
    log_dir; checkpoint_every (steps; default: once an epoch)."""
    import time

    model = prepare_model(new_model())
    optimizer = new_optimizer(model)
    start_epoch = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    x, y = dataset()
    ids = torch.arange(SAMPLES)
    loader = prepare_data_loader(DataLoader(ids, batch_size=4, shuffle=True))
    every = config.get("checkpoint_every")
    for epoch in range(start_epoch, config["epochs"]):
        if et.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            fault_once(config, epoch * 100 + step, et.get_context().get_world_rank())
            loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx = et.get_context()
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                         generation=ctx.get_generation(), epoch=epoch, step=step, batch=batch.tolist(),
                         loss=loss.item())
            time.sleep(config.get("step_time", 0.0))
            if every and (step + 1) % every == 0:
                _report(model, optimizer, epoch, {"epoch": epoch, "step": step, "loss": loss.item()}, last=False)
        if not every:
            _report(model, optimizer, epoch, {"epoch": epoch, "loss": loss.item()}, last=True)


def _report(model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, metrics: dict, last: bool) -> None:
    """Rank 0 alone saves; every rank reports. A checkpoint in mid-epoch resumes that epoch afresh:
    `epoch` is the last one done."""
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if et.get_context().get_world_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch if last else epoch - 1}, os.path.join(d, "model.pt"))
            checkpoint = et.Checkpoint.from_directory(d)
        et.report(metrics, checkpoint=checkpoint)


def completed_steps(log_dir: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Each step of the run's lineage, by (epoch, step): the ranks' records of its latest computation."""
    steps: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for p in read_progress(log_dir):
        if "batch" not in p:
            continue
        key = (p["epoch"], p["step"])
        if key in steps and steps[key][0]["generation"] != p["generation"]:
            if steps[key][0]["generation"] > p["generation"]:
                continue
            steps[key] = []  # redone after a re-entry: the latest computation counts
        steps.setdefault(key, []).append(p)
    return steps


def replay(log_dir: str) -> dict[str, torch.Tensor]:
    """The parameters of a fault-free run through the steps the ranks logged (see the module's docstring)."""
    model, (x, y) = new_model(), dataset()
    optimizer = new_optimizer(model)
    for _, records in sorted(completed_steps(log_dir).items()):
        grads = []
        for record in records:
            model.zero_grad()
            batch = torch.tensor(record["batch"])
            torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *rank_grads in zip(model.parameters(), *grads):
            p.grad = torch.stack(rank_grads).mean(dim=0)
        optimizer.step()
    return model.state_dict()


def final_state(result: et.Result) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "model.pt"), weights_only=True)["model"]
