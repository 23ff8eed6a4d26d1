"""Ray Train's backend API (`ray.train.backend`), as far as elastic_train takes it.

In Ray a `BackendConfig` names a `Backend` whose hooks set a framework's communication up on each
new worker group. Here every generation's workers form a `torch.distributed` group themselves
(worker/group/generation.py), re-formed at every membership change with no controller in between, so a
`DataParallelTrainer` takes a `BackendConfig` whose backend has no hooks of its own (`TorchConfig`,
or the base class): `check_backend` refuses one that has, naming why."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from elastic_train.errors import ConfigError


class BackendConfig:
    """The configuration of a training backend; `backend_cls` is its `Backend`."""

    @property
    def backend_cls(self) -> type["Backend"]:
        return Backend

    @property
    def train_func_context(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A context manager the loop runs in, on every worker."""
        return contextlib.nullcontext

    @property
    def framework(self) -> str | None:
        return None

    def to_dict(self) -> dict[str, Any]:
        """The config's fields that can be shown or stored."""
        return {}


class Backend:
    """A backend's hooks (Ray's: called with the worker group as it starts, before training, and as
    it shuts down). Subclasses that override them are refused (`check_backend`)."""

    share_cuda_visible_devices: bool = False

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Ray: the worker group started."""

    def on_training_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Ray: right before training starts."""

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        """Ray: the worker group is shutting down."""


def check_backend(config: BackendConfig) -> None:
    """Refuse a backend that sets communication up itself: its hooks, or a context for the loop."""
    backend = config.backend_cls
    custom = [hook for hook in ("on_start", "on_training_start", "on_shutdown")
              if getattr(backend, hook) is not getattr(Backend, hook)]
    if type(config).train_func_context is not BackendConfig.train_func_context:
        custom.append("train_func_context")
    if custom:
        raise ConfigError(
            f"{type(config).__name__} sets communication up itself ({', '.join(custom)}): elastic_train's workers "
            "form a torch.distributed group themselves at every generation, re-formed when a worker is lost or "
            "joins, with no hook in between. Use elastic_train.torch.TorchConfig (backend, timeout_s), and set "
            "anything else up at the start of train_loop_per_worker, which every generation runs.")
