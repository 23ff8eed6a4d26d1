"""`TorchConfig`: Ray Train's process-group settings (`ray.train.torch.TorchConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_train.backend import BackendConfig
from elastic_train.errors import ConfigError

BACKENDS = ("gloo", "nccl")
INIT_METHODS = ("env", "tcp")


@dataclass(frozen=True)
class TorchConfig(BackendConfig):
    """How each generation's `torch.distributed` process group is set up; validated on construction.

    `backend`: "nccl" or "gloo"; None (the default) picks NCCL when the run uses GPUs, else gloo,
    as Ray does. NCCL needs `ScalingConfig(use_gpu=True)`. Gloo with GPUs is refused rather than
    leaving each worker's GPU idle: the runtime's GPU path (device placement, abortable
    communicators for in-place recovery) is NCCL's. Ray's comma-separated device:backend lists and
    custom backends are not supported.

    `init_method`: "env" or "tcp", accepted for compatibility and equivalent: every generation
    rendezvouses through a fresh `TCPStore` that the supervisor hands out, whichever is named (the
    group is re-formed at every membership change, so a fixed address or environment cannot serve).

    `timeout_s`: seconds before a `torch.distributed` operation fails (Ray's default, 1800). It
    becomes `ElasticConfig.collective_timeout_s`. Lost workers are found by their heartbeats well
    before that; it only bounds a collective stuck among live processes.
    """

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(
                f"TorchConfig.backend={self.backend!r}: use 'nccl' (GPUs), 'gloo' (CPUs), or None to pick by "
                "ScalingConfig.use_gpu."
            )
        if self.init_method not in INIT_METHODS:
            raise ConfigError(
                f"TorchConfig.init_method={self.init_method!r}: use 'env' or 'tcp' (both rendezvous through the "
                "run's own TCPStore)."
            )
        timeout = self.timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(f"TorchConfig.timeout_s={timeout!r}: use a positive number of seconds, e.g. 1800.")

    def resolve_backend(self, use_gpu: bool) -> str:
        """The backend a run with (`use_gpu`) or without GPUs uses; ConfigError when they do not fit."""
        if self.backend is None:
            return "nccl" if use_gpu else "gloo"
        if self.backend == "nccl" and not use_gpu:
            raise ConfigError(
                "TorchConfig(backend='nccl') needs GPUs: set ScalingConfig(use_gpu=True), or use backend='gloo' "
                "(or None) to train on CPUs."
            )
        if self.backend == "gloo" and use_gpu:
            raise ConfigError(
                "TorchConfig(backend='gloo') with ScalingConfig(use_gpu=True) is not supported: GPU runs use NCCL, "
                "whose communicators can be aborted for in-place recovery. Use backend='nccl' (or None)."
            )
        return self.backend

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}


__all__ = ["TorchConfig"]
