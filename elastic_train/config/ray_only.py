"""Ray Train's config fields that elastic_train does not have, refused by name: passing one fails
with what to use instead (a `ConfigError`), or, for those Ray deprecated, as Ray fails
(`RayDeprecatedError`), rather than with a bare TypeError."""

from __future__ import annotations

import functools
from typing import Any, Callable

from elastic_train.errors import ConfigError, RayDeprecatedError


def ray_only(fields: dict[str, str], deprecated: dict[str, str] | None = None) -> Callable[[type], type]:
    """Class decorator: passing one of `fields` (name -> what to use instead) raises a `ConfigError`,
    one of `deprecated` a `RayDeprecatedError`; the class lists both as `RAY_ONLY_FIELDS`."""
    deprecated = deprecated or {}

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name in sorted(kwargs.keys() & deprecated.keys()):
                raise RayDeprecatedError(f"{cls.__name__}({name}=...) is deprecated (as in Ray Train): "
                                         f"{deprecated[name]}.")
            for name in sorted(kwargs.keys() & fields.keys()):
                raise ConfigError(f"{cls.__name__}({name}=...) is Ray Train's; elastic_train does not support it: "
                                  f"{fields[name]}.")
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.RAY_ONLY_FIELDS = {**fields, **deprecated}
        return cls
    return wrap
