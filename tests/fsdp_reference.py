"""tests/test_fsdp.py's model, batches and step, and the fault-free run it is held to: the same steps at
the same world sizes, on plain gloo groups without Ray, the state carried from one world size to the
next by torch's own DCP planner. A module of its own, light to import: its ranks are spawned."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from elastic_train.torch.fsdp import shard
from elastic_train.torch.state import load_state, save_state
from tests.test_process_group import RESULT_TIMEOUT_S, _run
from tests.test_sharded_state import _init

BATCH = 12  # rows of each step's global batch: equal shares at 1, 2, 3 or 4 ranks
LR_STEP = 4  # the scheduler's period: each recovery must restore its count
SCHEDULE = "ELASTIC_TRAIN_TEST_SCHEDULE"  # the reference's world sizes, and where it keeps its state

Segment = tuple[int, int, int]  # (world size, first step, last step)


def blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
              for _ in range(3)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 16))


def wrapping() -> dict:
    """prepare_model's FSDP keywords: each encoder layer a unit."""
    return {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.TransformerEncoderLayer})}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 4, 16, generator=g), torch.randn(BATCH, 4, 16, generator=g)


def digest(model: torch.nn.Module) -> str:
    """The whole parameters' SHA-256 (a collective: each rank gathers every shard)."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().full_tensor().cpu().numpy().tobytes())
    return h.hexdigest()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, rank: int,
               world: int, device: torch.device) -> float:
    """One step on this rank's rows of the global batch; the batch's mean loss (a collective)."""
    x, y = (t.to(device) for t in batch(step))
    per = BATCH // world
    loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def _schedule(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """Every segment of the schedule in turn, each on a fresh gloo group of its first ranks (the others
    wait for it), loading the state the previous one saved with DCP; rank 0 answers each step's loss
    and parameters' digest."""
    plan = json.loads(os.environ[SCHEDULE])
    torch.set_num_threads(1)  # as Ray's workers of fractional CPUs run (OMP_NUM_THREADS=1): the same sums
    steps = {}
    for n, (size, first, last) in enumerate(plan["segments"]):
        if rank < size:
            _init(rank, size, ports[n])
            model = shard(blocks(), wrapping(), torch.device("cpu"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=0.5)
            if n:
                scheduler.load_state_dict(load_state(Path(plan["dir"], str(n - 1)), model, optimizer)["scheduler"])
            for step in range(first, last + 1):
                loss = train_step(model, optimizer, scheduler, step, rank, size, torch.device("cpu"))
                steps[step] = (loss, digest(model))
            save_state(Path(plan["dir"], str(n)), model, optimizer, extra={"scheduler": scheduler.state_dict()})
            dist.destroy_process_group()
            if control.add(f"segment{n}", 1) == size:  # the last of its ranks to finish
                control.set(f"segment{n}/done", "1")
        control.wait([f"segment{n}/done"], timedelta(seconds=RESULT_TIMEOUT_S))  # a whole segment, for the idle
    return steps if rank == 0 else {}


def same_schedule_without_faults(segments: list[Segment], scratch: Path) -> dict[int, tuple[float, str]]:
    """Each step's loss and parameters' digest in a fault-free run of `segments`."""
    os.environ[SCHEDULE] = json.dumps({"segments": segments, "dir": str(scratch)})
    try:
        result = _run(_schedule, max(size for size, _, _ in segments), generations=len(segments), reporting=[0])
    finally:
        del os.environ[SCHEDULE]
    return {int(step): tuple(value) for step, value in result[0].items()}
