"""Names of Ray Train's API that elastic_train does not provide, and what to use instead.

A name that Ray 2.60 has (`TRAIN_NAMES`) imports as in Ray, since code imports it beside the names it
uses (Ray's own test utilities import `SyncConfig`), and building one raises `UnsupportedAPIError` with
why and what to use. A name Ray removed, or a module for another framework, fails where it is imported,
with the same message instead of a bare "cannot import name": the packages' module-level `__getattr__`
raises `UnsupportedAPIError`, an ImportError (an AttributeError there would be replaced by Python's
generic ImportError), so `hasattr(module, name)` raises too for these names, rather than answer False.
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
    "ValidationConfig": _VALIDATION,
    "ValidationFn": _VALIDATION,
    "ValidationTaskConfig": _VALIDATION,
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


def refused_class(name: str, why: str, module: str = "elastic_train", ray_module: str = "ray.train") -> type:
    """Ray Train's class `module.name`, importable, whose construction says why it is not supported."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedAPIError(f"{module}.{name} ({ray_module}.{name}) is not supported: {why}", name=module)

    return type(name, (), {"__init__": __init__, "__module__": __name__,
                           "__doc__": f"Ray Train's `{name}`: imported as in Ray, refused when built: {why}"})


SyncConfig = refused_class("SyncConfig", TRAIN_NAMES["SyncConfig"])
LoggingConfig = refused_class("LoggingConfig", TRAIN_NAMES["LoggingConfig"])
ValidationConfig = refused_class("ValidationConfig", TRAIN_NAMES["ValidationConfig"])
ValidationFn = refused_class("ValidationFn", TRAIN_NAMES["ValidationFn"])
ValidationTaskConfig = refused_class("ValidationTaskConfig", TRAIN_NAMES["ValidationTaskConfig"])

__all__ = ["UnsupportedAPIError", "TRAIN_NAMES", "MODULES", "lazy_getattr", "refuse_unsupported_modules",
           "unsupported_getattr", "refused_class", "SyncConfig", "LoggingConfig", "ValidationConfig", "ValidationFn",
           "ValidationTaskConfig"]
