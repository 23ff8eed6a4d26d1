"""A survivor's process across generations: what torch keeps of the previous world is reset
(worker/group/process_state.py). Ranks are spawned processes that join three generations through
`GenerationGroup`, as workers do, the last two renumbering them (rank 1 <-> 2)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic_train.protocol import Assignment
from elastic_train.worker.group.generation import GenerationGroup
from elastic_train.worker.group.process_state import reset_for_generation
from tests.helpers import run_gloo_ranks

TIMEOUT_S = 60.0
WORLD = 3
RENUMBERED = {0: 0, 1: 2, 2: 1}  # generation 1's rank of each generation-0 rank


def _model(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Ray's FSDP2 guide's shape: each block sharded, then the root, over a 1-D mesh of the world."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(3)])
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loss(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    per = 6 // world
    return torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])


def _mean_loss(model: torch.nn.Module, step: int, rank: int, world: int) -> float:
    with torch.no_grad():
        loss = _loss(model, step, rank, world)
    dist.all_reduce(loss)
    return loss.item() / world


@torch.compile(backend="eager")
def _place_compiled(x: torch.Tensor) -> torch.Tensor:
    return x * dist.get_rank() + dist.get_world_size()


def _join(group: GenerationGroup, generation: int, rank: int, port: int) -> None:
    group.join(Assignment(generation, rank, WORLD, rank, WORLD, 0, "127.0.0.1", port, None, {}))


def _rank_main(first: int, port: int, ports: tuple[int, int], folder: str, conn: Any) -> None:
    """Generation 0 trains and saves; generation 1 renumbers the ranks without the reset (what torch
    hands the renumbered ones is recorded); generation 2 renumbers them alike, with the reset."""
    try:
        group = GenerationGroup("gloo", TIMEOUT_S, TIMEOUT_S, TIMEOUT_S)
        _join(group, 0, first, port)
        model, optimizer = _model(WORLD)
        for step in (1, 2):
            _loss(model, step, first, WORLD).backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = tempfile.mkdtemp()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=saved)
        for name in os.listdir(saved):  # the ranks' parts, merged into one folder as a checkpoint's files are
            shutil.copy(os.path.join(saved, name), folder)
        before = _mean_loss(model, 3, first, WORLD)
        _place_compiled(torch.ones(1))
        dist.barrier()
        group.leave()

        rank = RENUMBERED[first]
        _join(group, 1, rank, ports[0])  # no reset
        stale = _model(WORLD)[0][0][0].weight.device_mesh.get_coordinate()
        dist.barrier()
        group.leave()

        _join(group, 2, rank, ports[1])
        reset_for_generation((first, WORLD), (rank, WORLD))  # the caches hold generation 0's world
        model, optimizer = _model(WORLD)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        conn.send({"before": before, "after": _mean_loss(model, 3, rank, WORLD), "first": first, "rank": rank,
                   "stale": stale, "coordinate": model[0][0].weight.device_mesh.get_coordinate(),
                   "compiled": _place_compiled(torch.ones(1)).item()})
        dist.barrier()
        group.leave()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_a_renumbered_survivor_builds_its_fsdp2_shards_and_compiled_code_for_its_new_rank():
    folder, ports = tempfile.mkdtemp(), (_free_port(), _free_port())
    try:
        results = run_gloo_ranks(_rank_main, WORLD, lambda rank: (ports, folder), TIMEOUT_S * 2)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    for r in results:
        # Without the reset, torch hands a renumbered rank its old coordinate (if a newer torch no longer
        # does, its caches do not go stale: worker/group/process_state.py may say so).
        assert r["stale"] == (r["first"],), r
        assert r["coordinate"] == (r["rank"],), r  # FSDP2's parameters are on the new generation's mesh
        assert r["after"] == r["before"], r  # the DCP checkpoint loaded into the new rank's rows
        assert r["compiled"] == r["rank"] + WORLD, r  # compiled code sees the new rank
