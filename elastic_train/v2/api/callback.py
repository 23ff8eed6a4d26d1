"""`ray.train.v2.api.callback`."""

from elastic_train.callbacks import UserCallback

__all__ = ["UserCallback"]
