"""The kept state of a sharded model (FSDP2): each rank's share, copied at each report, and
re-sharded from the old world's shares to any new world.

Why a copy, where a replicated model's kept state is held by reference (worker/hold/kept_state.py): a rank's
share exists on that rank alone. A peer lost after the survivors' `optimizer.step()` leaves them a
newer state than the lost share, so the survivors need their share of the last report too, not
only its replica on the lost rank's buddy. The copy is one host memory copy of 1/N of the state; it
is serialized and sent to the buddy in the background (worker/hold/holdings.py), and its file is named by rank,
so the supervisor resumes from a report only where every old rank's share is held by a survivor.

When a share is copied, and when a buddy's older copies go: worker/report/share_copies.py.

The re-sharding is FSDP2's layout (DTensor `Shard(0)` on a 1-D mesh: `torch.chunk` rows): each new
rank takes the rows it owns at the new world from the old shares that hold them, reading only those.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

from elastic_train.errors import CheckpointError

# torch.distributed.tensor is imported where a sharded model is: its import (sympy's) takes half a
# second of every worker's and the supervisor's start.
Path = tuple[Any, ...]


def is_sharded(model: torch.nn.Module) -> bool:
    """Are `model`'s parameters DTensors (FSDP2's)? Such a model's kept state is its ranks' shares."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing has made a DTensor
        return False
    from torch.distributed.tensor import DTensor, Shard

    params = [p for p in model.parameters()]
    sharded = [p for p in params if isinstance(p, DTensor)]
    for p in sharded:
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"prepare_model(live_state=True) keeps an FSDP2 model sharded on its first dimension over a 1-D mesh "
                f"(fully_shard's default); this one has placements {p.placements} on a {p.device_mesh.ndim}-D mesh. "
                "Report a DCP checkpoint instead (elastic_train.torch.save_state).")
    return bool(sharded)


def local_copy(state: Any, rank: int) -> dict[str, Any]:
    """This rank's share of a state nest: every tensor copied to host memory, each DTensor as its local
    rows, noted with its global shape and first row."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shards: list[tuple[Path, tuple[int, ...], int]] = []

    def walk(value: Any, path: Path) -> Any:
        if isinstance(value, DTensor):
            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            shards.append((path, tuple(value.shape), offset[0] if offset else 0))
            return value.to_local().detach().to("cpu", copy=True)
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, path + (i,)) for i, v in enumerate(value))
        return value

    return {"state": walk(state, ()), "shards": shards, "rank": rank}


def _rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows `rank` owns of `rows` at `world` (torch.chunk's split, as Shard(0)'s)."""
    size = -(-rows // world) if rows else 0
    return min(rank * size, rows), min((rank + 1) * size, rows)


def needed(model: torch.nn.Module, old_world: int) -> list[int]:
    """The old ranks whose shares hold rows this rank owns now (the optimizers' state is laid out as
    the parameters are); at least one, for the values every rank holds alike."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    found: set[int] = set()
    for p in model.parameters():
        if not isinstance(p, DTensor) or not p.shape:
            continue
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        start, end = offset[0], offset[0] + shape[0]
        for old in range(old_world):
            low, high = _rows(p.shape[0], old_world, old)
            if max(start, low) < min(end, high):
                found.add(old)
    return sorted(found) or [0]


def reshard(shares: dict[int, dict[str, Any]], mesh: Any) -> Any:
    """The state nest for this rank of `mesh`, out of the old ranks' `shares` (those `needed` gives,
    at least): each sharded tensor a DTensor of the rows this rank owns now, every other value the
    lowest share's (all ranks hold those alike), all of it fresh tensors (the loop's optimizer writes
    what it is given; the shares must stay as reported)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    base = shares[min(shares)]
    offsets = {rank: {path: first for path, _, first in share["shards"]} for rank, share in shares.items()}
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else None
    built: dict[Path, DTensor] = {}
    for path, shape, _ in base["shards"]:
        local, offset = compute_local_shape_and_global_offset(shape, mesh, (Shard(0),))
        start, end = offset[0], offset[0] + local[0]
        pieces = []
        for rank in shares:
            held = _at(shares[rank]["state"], path)
            first = offsets[rank][path]
            low, high = max(start, first), min(end, first + held.shape[0])
            if low < high:
                pieces.append((low, held[low - first:high - first]))
        rows = torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])]) if pieces else torch.empty((0, *shape[1:]), dtype=_at(base["state"], path).dtype)
        if rows.shape[0] != end - start:
            raise CheckpointError(f"re-sharding {'.'.join(map(str, path))}: rows {start}-{end} are not all held by "
                                  f"the shares of old ranks {sorted(shares)}")
        rows = rows.to(device) if device is not None else rows
        built[path] = DTensor.from_local(rows, mesh, (Shard(0),), run_check=False, shape=torch.Size(shape),
                                         stride=_contiguous(shape))

    def walk(value: Any, path: Path) -> Any:
        if path in built:
            return built[path]
        if isinstance(value, torch.Tensor):  # on the host: a buffer loads into the model's, and an optimizer
            return value.clone()  # moves its step count where its policy has it (a CPU step: no sync per step)
        if isinstance(value, dict):
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, path + (i,)) for i, v in enumerate(value))
        return value

    return walk(base["state"], ())


def mesh_of(model: torch.nn.Module) -> Any:
    """The device mesh a sharded model's parameters are laid out on."""
    from torch.distributed.tensor import DTensor

    return next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))


def _at(nest: Any, path: Iterable[Any]) -> Any:
    for key in path:
        nest = nest[key]
    return nest


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
