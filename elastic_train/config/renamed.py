"""Config fields that elastic_train renamed: the old name still works, with a `DeprecationWarning`
that names the new one, so a config written for an earlier release keeps its meaning."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

from elastic_train.errors import ConfigError


def renamed(fields: dict[str, str]) -> Callable[[type], type]:
    """Class decorator: `fields` maps an old keyword to its new name; passing the old one warns and
    sets the new one, passing both is refused. The class lists them as `RENAMED_FIELDS`."""

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for old in sorted(kwargs.keys() & fields.keys()):
                new = fields[old]
                if new in kwargs:
                    raise ConfigError(f"{cls.__name__}({old}=..., {new}=...): {old} is the old name of {new}; "
                                      f"pass {new} alone.")
                warnings.warn(f"{cls.__name__}({old}=...) is now {cls.__name__}({new}=...); the old name "
                              "will be removed in a later release.", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.RENAMED_FIELDS = dict(fields)
        return cls
    return wrap
