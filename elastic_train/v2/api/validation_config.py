"""Ray V2's `ray.train.v2.api.validation_config`: its names import as in Ray (Ray's own test utilities
import them), and building one says that checkpoint validation is not supported and what to do instead
(unsupported.py)."""

from elastic_train.unsupported import ValidationConfig, ValidationFn, ValidationTaskConfig

__all__ = ["ValidationConfig", "ValidationFn", "ValidationTaskConfig"]
