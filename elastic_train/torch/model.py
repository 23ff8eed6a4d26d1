"""Device placement and DDP wrapping for the current generation's process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def get_device() -> torch.device:
    """This worker's device: its GPU when the run uses GPUs (NCCL), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Move `model` to this worker's device and wrap it in DDP when the world has several ranks.

    Call it on every generation's entry into the loop (the loop does): the DDP wrapper is bound to
    the process group of the generation it was made in.
    """
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    if parallel_strategy != "ddp":
        raise ValueError(f"prepare_model(parallel_strategy={parallel_strategy!r}): only 'ddp' or None is supported.")
    kwargs = dict(parallel_strategy_kwargs or {})
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, **kwargs)
