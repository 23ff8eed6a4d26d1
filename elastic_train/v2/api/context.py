"""Ray V2's `ray.train.v2.api.context`: the loop's `TrainContext` (worker/loop/context.py)."""

from elastic_train.worker.loop.context import TrainContext

__all__ = ["TrainContext"]
