"""Ray Train's `ray.train.context`: `TrainContext`, what `get_context()` returns (worker/loop/context.py)."""

from elastic_train.api import get_context
from elastic_train.worker.loop.context import TrainContext

__all__ = ["TrainContext", "get_context"]
