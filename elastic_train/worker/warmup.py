"""A new worker pays PyTorch's first-use costs before it joins a generation.

Why: a worker process that joins a running generation makes its peers wait for everything its loop
does first, up to the first collective. In a fresh process the first `torch.optim` optimizer imports
`torch._dynamo` (0.8 s on the 2-core test machine, as long as eight 100 ms steps), the first backward
starts autograd's threads, and with GPUs the first CUDA call creates the context. Done here, while
the worker is still on its way to the supervisor, those costs fall on no one: the others keep
training until it parks. The first generation's workers skip it: they all pay the same costs in
their loops at once, and a run's start (each test's too) is 0.8 s shorter. With datasets, Ray Data is imported
too (the loop's `get_dataset_shard` would import it after the worker joined, its peers waiting).
"""

from __future__ import annotations

import importlib
import logging
import time

import torch

logger = logging.getLogger(__name__)


def warm_up(use_cuda: bool, datasets: bool) -> float:
    """One throwaway optimizer step on a tiny model (and, with `use_cuda`, a CUDA tensor); with
    `datasets`, Ray Data imported (0.8 s here) for the loop's `get_dataset_shard`; returns the seconds
    it took."""
    began = time.monotonic()
    if datasets:
        importlib.import_module("ray.data")  # what the loop's dataset shard (ingest/shard.py) is built on
    device = torch.device("cuda") if use_cuda and torch.cuda.is_available() else torch.device("cpu")
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.zeros(1, 4, device=device)).sum().backward()
    optimizer.step()
    took = time.monotonic() - began
    logger.debug("warmed up in %.3fs", took)
    return took
