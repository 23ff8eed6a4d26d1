"""Training loops the tests run on workers: tiny, deterministic, and instrumented.

Each rank appends one JSON line per completed step to `<log_dir>/progress.jsonl`, so a test can see
what every process did: pid, rank, world size, generation, step, and time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import ray
import torch

import elastic_train as et
from elastic_train.torch import get_device, keep_state, prepare_model


def log_progress(log_dir: str, **record) -> None:
    with open(os.path.join(log_dir, "progress.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n")


def read_progress(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fault_once(config: dict, step: int, rank: int, point: str = "step_start", generation: int | None = None) -> None:
    """Inject each configured fault once. `config["fault"]` is one fault or a list of them:
    {"kind": "kill"|"stop"|"term"|"raise"|"hang", "rank", "point", and "at_step" or "at_generation"}. "hang"
    blocks the loop for good while the process (and its heartbeat thread) stays alive. The first
    fault's record is fault.json, the n-th's fault-n.json."""
    faults = config.get("fault") or []
    for n, fault in enumerate([faults] if isinstance(faults, dict) else faults):
        if (rank == fault["rank"] and fault.get("point", "step_start") == point
                and fault.get("at_step", step) == step and fault.get("at_generation", generation) == generation):
            _inject(fault, Path(config["log_dir"]) / ("fault.json" if n == 0 else f"fault-{n}.json"), step)


def _inject(fault: dict, marker: Path, step: int) -> None:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, json.dumps({"pid": os.getpid(), "time": time.time(), "step": step}).encode())
    os.close(fd)
    if fault["kind"] == "raise":
        raise ValueError(f"injected user error at step {step}")
    if fault["kind"] == "hang":
        threading.Event().wait()
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault["kind"]])


def linear_regression_loop(config: dict) -> None:
    """A model fit step by step, a checkpoint reported every step, faults on request. Each step's line
    says whether the process had paid PyTorch's first-use costs before the loop began (`warm`:
    worker/warmup.py)."""
    warm = "torch._dynamo" in sys.modules  # the first optimizer imports it: 0.8 s a peer would wait for
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = prepare_model(model)
    ctx = et.get_context()
    device = get_device()
    true_w = torch.arange(8, dtype=torch.float32, device=device).unsqueeze(1)
    for step in range(start + 1, config["steps"] + 1):
        fault_once(config, step, ctx.get_world_rank())
        g = torch.Generator().manual_seed(step * 1000 + ctx.get_world_rank())
        x = torch.randn(16, 8, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ true_w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # A straggler of the first generation: the machine it ran on is gone by the next.
        straggles = (ctx.get_world_rank(), ctx.get_generation()) == (config.get("slow_rank"), 0)
        slow = config.get("slow_s", 0.0) if straggles else 0.0
        time.sleep(config.get("step_time", 0.0) + slow)
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                     generation=ctx.get_generation(), step=step, node=ray.get_runtime_context().get_node_id(), warm=warm)
        fault_once(config, step, ctx.get_world_rank(), point="before_report")
        saves = not config.get("rank0_saves") or ctx.get_world_rank() == 0  # Ray Train's usual pattern
        saves = saves and config.get("checkpoints", True)
        et.report(
            {"loss": loss.item(), "step": step},
            checkpoint=et.Checkpoint.from_dict(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            ) if saves else None,
        )


def sample_counting_loop(config: dict) -> None:
    """Counts, in replicated model state, how often each sample contributed to a step.

    Each step, every rank adds ones at its batch's sample ids and the counts are all-reduced; the
    count vector is checkpointed every step, and a re-entered loop's loader goes on mid-epoch
    (`prepare_data_loader(resume_mid_epoch=True)`). After a clean run of E epochs every count is E: any
    sample skipped or repeated within an epoch (across kills and resizes) shows up as a wrong count.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from elastic_train.torch import prepare_data_loader

    n, epochs = config["samples"], config["epochs"]
    counts, step = torch.zeros(n), 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        counts, step = state["counts"], state["step"]
    loader = prepare_data_loader(
        DataLoader(torch.arange(n), batch_size=4, shuffle=True), global_batch_size=config["global_batch_size"],
        resume_mid_epoch=True,  # no fast-forward of its own: the loader goes on from the checkpoint's position
    )
    ctx = et.get_context()
    # The loader knows the epoch to go on in: a checkpoint of an epoch's last step resumes in the next.
    for epoch in range(loader.epoch, epochs):
        for batch in loader:
            step += 1
            fault_once(config, step, ctx.get_world_rank())
            delta = torch.zeros(n)
            delta[batch] += 1
            dist.all_reduce(delta)
            counts += delta
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                         generation=ctx.get_generation(), step=step, epoch=epoch, batch=batch.tolist())
            time.sleep(config.get("step_time", 0.0))
            fault_once(config, step, ctx.get_world_rank(), point="before_report")
            et.report({"step": step, "epoch": epoch},
                      checkpoint=et.Checkpoint.from_dict({"counts": counts, "epoch": epoch, "step": step}))
        if ctx.get_world_rank() == 0:
            log_progress(config["log_dir"], rank=0, epoch_done=epoch, counts=counts.tolist())


def sharded_directory_loop(config: dict) -> None:
    """Each rank reports a directory with its own shard file plus a replicated `common.txt`.

    The shard files hold the step, so a test can see that a restored checkpoint is one whole step.
    """
    import tempfile

    start = 0
    checkpoint = et.get_checkpoint()
    ctx = et.get_context()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            names = sorted(os.listdir(d))
            steps = {Path(d, n).read_text() for n in names}
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), restored=names, restored_steps=sorted(steps),
                         generation=ctx.get_generation())
            start = int(Path(d, "common.txt").read_text())
    for step in range(start + 1, config["steps"] + 1):
        fault_once(config, step, ctx.get_world_rank())
        time.sleep(config.get("step_time", 0.0))
        with tempfile.TemporaryDirectory() as d:
            Path(d, f"shard_{ctx.get_world_rank()}.txt").write_text(str(step))
            Path(d, "common.txt").write_text(str(step))
            et.report({"step": step}, checkpoint=et.Checkpoint.from_directory(d))


def shard_payload(step: int, size: int) -> bytes:
    """A shard's bytes at `step`: the step number repeated, so a reader can tell a whole shard of one step."""
    return f"{step:08d}".encode() * (size // 8)


def spins_after_one_report(config: dict) -> None:
    """Reports once, then computes for good without a report or a collective (as Ray's sigint test's loop)."""
    et.report({"step": 1})
    while True:
        pass


def large_shard_loop(config: dict) -> None:
    """Each rank reports `shard_<rank>.bin` (`shard_mb` MB) every step; on resume, logs what it got."""
    import tempfile

    ctx = et.get_context()
    size = int(config["shard_mb"] * 2**20) // 8 * 8
    start = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            shards = {}
            for name in sorted(os.listdir(d)):
                data = Path(d, name).read_bytes()
                steps = {data[i : i + 8] for i in range(0, len(data), 8)}
                shards[name] = {"size": len(data), "steps": sorted(int(s) for s in steps)}
            log_progress(config["log_dir"], rank=ctx.get_world_rank(), restored=shards, world=ctx.get_world_size())
            start = shards[f"shard_{ctx.get_world_rank()}.bin"]["steps"][0]
    end = start + config["steps_after_restore"] if checkpoint is not None else config["steps"]
    for step in range(start + 1, end + 1):
        time.sleep(config.get("step_time", 0.0))
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(), step=step)
        with tempfile.TemporaryDirectory() as d:
            Path(d, f"shard_{ctx.get_world_rank()}.bin").write_bytes(shard_payload(step, size))
            et.report({"step": step}, checkpoint=et.Checkpoint.from_directory(d))


def dcp_loop(config: dict) -> None:
    """DDP + Adam, saved every step with `save_state` (DCP), resumed with `load_state` at any world size.

    A global batch of 24 samples is split evenly over the ranks, so the math does not depend on the
    world size (up to float rounding). After a load, rank 0 saves the loaded parameters to the log dir.
    """
    import tempfile

    from elastic_train.torch.state import load_state, save_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = prepare_model(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    ctx = et.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = load_state(d, ddp, optimizer)["step"]
        if rank == 0:
            torch.save({k: v.clone() for k, v in model.state_dict().items()},
                       Path(config["log_dir"], f"loaded_world{world}_step{start}.pt"))
    per_rank = 24 // world
    for step in range(start + 1, config["steps"] + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(24, 6, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with tempfile.TemporaryDirectory() as d:
            save_state(d, ddp, optimizer, extra={"step": step})
            et.report({"step": step, "loss": loss.item()}, checkpoint=et.Checkpoint.from_directory(d))


def batch_norm_loop(config: dict) -> dict:
    """A model with BatchNorm under DDP's defaults (its buffers broadcast at every forward) and a step
    LR schedule, its state kept live, no checkpoint: the pattern of a ResNet trained with
    `prepare_model(live_state=True)`, the scheduler kept with it (`keep_state`). Every rank trains on
    the same batch (seeded by step), so the math does not depend on the world size; returns the final
    model and optimizer state and learning rate. Faults on request (`fault_once`)."""
    ctx = et.get_context()
    torch.manual_seed(0)
    model = prepare_model(batch_norm_model(), live_state=True)
    optimizer, scheduler = batch_norm_optimizer(model)
    keep_state(scheduler)
    for step in range(ctx.get_resume_index() + 1, config["steps"] + 1):
        fault_once(config, step, ctx.get_world_rank())
        batch_norm_step(model, optimizer, step, lambda: fault_once(config, step, ctx.get_world_rank(), "after_forward"))
        scheduler.step()
        time.sleep(config.get("step_time", 0.0))
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), generation=ctx.get_generation(), step=step)
        et.report({"step": step})
    inner = model.module if hasattr(model, "module") else model
    return {"model": inner.state_dict(), "optimizer": optimizer.state_dict()["state"], "lr": scheduler.get_last_lr()}


def batch_norm_optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """SGD with momentum, its learning rate halved every 4 steps: a recovery between two halvings
    that restarted the schedule would halve it at the wrong steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def batch_norm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def batch_norm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    after_forward: Callable[[], None] = lambda: None) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
    optimizer.zero_grad()
    loss = model(x).pow(2).mean()
    after_forward()
    loss.backward()
    optimizer.step()
