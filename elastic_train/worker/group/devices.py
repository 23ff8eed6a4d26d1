"""This worker's devices, as the generation's process group decides them: its GPUs under NCCL, else the
CPU (Ray Train's `ray.train.torch.get_device(s)`). Here so that data (ingest/shard.py) and the model
(torch/model.py) place tensors alike without one importing the other."""

from __future__ import annotations

import os

import ray
import torch
import torch.distributed as dist


def get_device() -> torch.device:
    """This worker's device: its GPU when the run uses GPUs (NCCL), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_devices() -> list[torch.device]:
    """Every device of this worker: with GPUs, each GPU Ray assigned it (`resources_per_worker={"GPU": 2}`
    gives two), as CUDA devices of this process, in `ray.get_gpu_ids()` order, as Ray Train does;
    else the CPU alone."""
    device = get_device()
    if device.type != "cuda":
        return [device]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d and d != "NoDevFiles"]
    assigned = [str(gpu) for gpu in ray.get_gpu_ids()] if ray.is_initialized() else []
    if not visible or not assigned:
        return [device]
    missing = [gpu for gpu in assigned if gpu not in visible]
    if missing:
        raise RuntimeError(
            f"CUDA_VISIBLE_DEVICES={','.join(visible)} does not include the GPUs Ray assigned this worker "
            f"({', '.join(missing)}): do not override CUDA_VISIBLE_DEVICES in the training loop."
        )
    return [torch.device("cuda", visible.index(gpu)) for gpu in assigned]
