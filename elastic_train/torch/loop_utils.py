"""Ray Train's training-loop helpers: `enable_reproducibility`, and `accelerate`, `prepare_optimizer`,
`backward` for loops written for Ray's older API.

Ray Train deprecated the last three (its V2 raises on them); here they run such loops unchanged in
full precision. Mixed precision through them (`accelerate(amp=True)`) is refused rather than
silently ignored: PyTorch's own AMP API does it in a few lines and keeps the scaler in the user's
hands (and checkpoints).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from elastic_train.errors import ConfigError

_AMP_INSTEAD = (
    "use PyTorch's AMP API in the loop: `with torch.autocast(device_type=get_device().type):` around the "
    "forward pass, and a `torch.amp.GradScaler()` for backward and step (save `scaler.state_dict()` in the "
    "checkpoint). Ray Train deprecated accelerate/prepare_optimizer/backward for the same reason."
)


def enable_reproducibility(seed: int = 0) -> None:
    """Limit sources of nondeterminism, as Ray Train does: seed PyTorch, Python and NumPy, make
    PyTorch use deterministic algorithms, turn off cuDNN benchmarking, and set the cuBLAS workspace
    that deterministic CUDA matmuls need.

    After a recovery the loop is re-entered in the same process, so a call at its top seeds the
    resumed run as a fresh one: for bit-exact resumption, keep RNG states in the checkpoint.
    """
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def accelerate(amp: bool = False) -> None:
    """Ray's switch for automatic mixed precision. Without AMP there is nothing to set up, and it may
    be called again when the loop is re-entered after a recovery; `amp=True` raises ConfigError."""
    if amp:
        raise ConfigError(f"elastic_train.torch.accelerate(amp=True) is not supported: {_AMP_INSTEAD}")


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer itself: without AMP, Ray's wrapper only forwards to it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"prepare_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    return optimizer


def backward(tensor: torch.Tensor) -> None:
    """`tensor.backward()`: without AMP there is no loss scaling to apply."""
    tensor.backward()


__all__ = ["enable_reproducibility", "accelerate", "prepare_optimizer", "backward"]
