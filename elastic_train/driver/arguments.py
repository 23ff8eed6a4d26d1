"""The trainer's arguments checked in the driver, before any actor starts: its configs given as
objects or dicts of options, the loop and its config, the metadata. Each bad input fails with a
`ConfigError` that names the problem and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
from typing import Any, Mapping

from elastic_train.errors import ConfigError, qualified


def checked_options(cls: type, options: Mapping[str, Any]) -> Any:
    """Build `cls(**options)`, naming any unknown key and the keys that exist."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known - set(getattr(cls, "RENAMED_FIELDS", {})))
    if unknown:
        close = [match for name in unknown for match in difflib.get_close_matches(name, known, n=1)]
        raise ConfigError(
            f"{cls.__name__} has no option {', '.join(map(repr, unknown))}"
            + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
            + f"; known options: {', '.join(sorted(known))}."
        )
    return cls(**options)


def as_config(cls: type, value: Any, owner: str) -> Any:
    """The argument `owner` as a `cls`: given as one, as a dict of its options, or None (defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return checked_options(cls, value)
    raise ConfigError(f"{owner} must be an elastic_train.{cls.__name__} or a dict of its options, got "
                      f"{qualified(value)}: use `elastic_train.{cls.__name__}` instead.")


def check_loop(fn: Any, config: Any) -> bool:
    """Validate the loop and its config; returns whether the loop takes the config argument."""
    if not callable(fn):
        raise ConfigError(
            f"train_loop_per_worker must be a function, got {type(fn).__name__}: "
            "pass the function itself, e.g. TorchTrainer(train_func, ...), not train_func()."
        )
    if config is not None and not isinstance(config, Mapping):
        raise ConfigError(f"train_loop_config must be a dict, got {type(config).__name__}.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > 1:
        raise ConfigError(
            "train_loop_per_worker must take no argument or one (the train_loop_config dict); "
            f"{getattr(fn, '__name__', fn)} requires {len(required)}."
        )
    takes_config = bool(positional) or varargs
    if config is not None and not takes_config:
        raise ConfigError(
            "train_loop_config was given, but train_loop_per_worker takes no argument to receive it: "
            "add a `config` parameter."
        )
    return takes_config


def checked_metadata(metadata: Any) -> dict[str, Any]:
    """TorchTrainer(metadata=...): a dict that JSON can hold (it is kept in the run record)."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}.")
    try:
        json.dumps(dict(metadata))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"metadata must be JSON-serializable (strings, numbers, lists, dicts): {exc}.") from exc
    return dict(metadata)
