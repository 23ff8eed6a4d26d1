"""`ray.train.v2.api.result`."""

from elastic_train.result import Result

__all__ = ["Result"]
