"""Names of Ray Train's API that elastic_train does not provide, and what to use instead.

Code ported by changing `ray.train` to `elastic_train` in its imports fails on such a name with a
message that says why and names the replacement, instead of a bare "cannot import name". The
packages' module-level `__getattr__` raises `UnsupportedAPIError`, an ImportError: it is what
`from elastic_train import get_dataset_shard` raises, with the message (an AttributeError there
would be replaced by Python's generic ImportError). `hasattr(elastic_train, name)` therefore raises
too for these names, rather than answer False.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import Any, Callable, Mapping

_VALIDATION = (
    "Ray's asynchronous checkpoint validation is not supported. Validate in the loop before report() "
    "(e.g. on rank 0, reporting the result as a metric), in a RunConfig callback's after_report, or "
    "after fit() on result.best_checkpoints."
)

TRAIN_NAMES: Mapping[str, str] = {
    "SyncConfig": (
        "there is nothing to sync (Ray deprecated it too): workers write checkpoints straight to "
        "RunConfig(storage_path=...), any fsspec URL, with credentials in RunConfig(storage_options=...)."
    ),
    "LoggingConfig": (
        "set the level of the 'elastic_train' logger with the logging module, in the driver and in the "
        "training loop: logging.getLogger('elastic_train').setLevel('DEBUG')."
    ),
    "NCCLHangError": (
        "a hung NCCL collective does not end the run here: it is detected (ElasticConfig.progress_timeout_s, "
        "collective_timeout_s), the group is aborted and re-formed in place. A run that fails raises "
        "elastic_train.WorkerGroupError or ControllerError; catch elastic_train.TrainingFailedError."
    ),
    "ValidationConfig": _VALIDATION,
    "ValidationFn": _VALIDATION,
    "ValidationTaskConfig": _VALIDATION,
}

TORCH_NAMES: Mapping[str, str] = {
    "TorchCheckpoint": (
        "use elastic_train.Checkpoint: Checkpoint.from_dict({'model': model.state_dict()}) (loaded with "
        "weights_only=True), or elastic_train.torch.save_state/load_state for model and optimizer state "
        "through torch.distributed.checkpoint."
    ),
}


_PYTORCH_ONLY = ("elastic_train trains PyTorch: use elastic_train.torch.TorchTrainer (PyTorch Lightning: "
                 "elastic_train.lightning; Hugging Face Transformers: elastic_train.huggingface).")

# Ray Train's modules for other frameworks (`ray.train.<name>`, and `ray.train.v2.<name>`).
MODULES: Mapping[str, str] = dict.fromkeys(("tensorflow", "xgboost", "lightgbm", "horovod", "jax"), _PYTORCH_ONLY)


class UnsupportedAPIError(ImportError):
    """A name of Ray Train's API that elastic_train does not provide; the message says what to use instead."""


class _UnsupportedModules(importlib.abc.MetaPathFinder):
    """Consulted after every other finder, so only for a module that does not exist: one of `MODULES`
    fails with what to use instead, rather than a bare ModuleNotFoundError."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        package, _, name = fullname.rpartition(".")
        if package in ("elastic_train", "elastic_train.v2") and name in MODULES:
            ray_module = f"ray.train.{fullname.removeprefix('elastic_train.')}"
            raise UnsupportedAPIError(f"{fullname} ({ray_module}) is not supported: {MODULES[name]}", name=fullname)
        return None


def refuse_unsupported_modules() -> None:
    """Make `import elastic_train.tensorflow` (and the other `MODULES`) say why it fails (once per process)."""
    if not any(isinstance(finder, _UnsupportedModules) for finder in sys.meta_path):
        sys.meta_path.append(_UnsupportedModules())


def unsupported_getattr(module: str, ray_module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `module` that raises UnsupportedAPIError for `names`."""

    def __getattr__(name: str) -> Any:
        if name in names:
            raise UnsupportedAPIError(
                f"{module}.{name} ({ray_module}.{name}) is not supported: {names[name]}", name=module
            )
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def lazy_getattr(namespace: dict[str, Any], where: Mapping[str, str],
                 otherwise: Callable[[str], Any]) -> Callable[[str], Any]:
    """A package's `__getattr__` (PEP 562) that imports each name of `where` (name -> its module, or
    the subpackage of that name) on first use and keeps it in the package's `namespace`, and answers
    `otherwise` for any other name. Why: the supervisor's process, and a loop that never uses FSDP or
    DCP, need not pay for importing them (about a second of each run's start)."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            return otherwise(name)
        module = importlib.import_module(where[name])
        namespace[name] = module if module.__name__.endswith(f".{name}") else getattr(module, name)
        return namespace[name]

    return __getattr__


ray_train_getattr = unsupported_getattr("elastic_train", "ray.train", TRAIN_NAMES)
ray_train_torch_getattr = unsupported_getattr("elastic_train.torch", "ray.train.torch", TORCH_NAMES)

__all__ = ["UnsupportedAPIError", "TRAIN_NAMES", "TORCH_NAMES", "MODULES", "lazy_getattr", "ray_train_getattr",
           "ray_train_torch_getattr", "refuse_unsupported_modules"]
