"""Hugging Face Transformers on elastic_train: Ray Train's `ray.train.huggingface` names.

`TransformersTrainer` runs a loop that builds and runs a `transformers.Trainer` itself (Ray's
`TransformersTrainer`, with the loop as Ray's guides now write it);
`elastic_train.huggingface.transformers` has `RayTrainReportCallback` and `prepare_trainer`, as
`ray.train.huggingface.transformers` does.

Importing this package (which importing `elastic_train.huggingface.transformers` does) makes every
generation of a worker start with fresh Accelerate state: Accelerate keeps the world size, rank and
device in process-wide singletons, and a survivor's process outlives its generation (see
`_accelerate.py`). The package is imported in a worker as soon as its loop is unpickled when the
loop refers to it (or is a `TransformersTrainer`'s); a loop that imports it only when it runs gets
the environment set at once, and the reset from its next generation on.
"""

from elastic_train.huggingface._accelerate import export_accelerate_env, start_generation
from elastic_train.huggingface.trainer import TransformersTrainer
from elastic_train.worker.loop.current import current_session, on_session_start

on_session_start(start_generation)
if current_session() is not None:  # imported by the running loop: its Accelerate state is this generation's own
    export_accelerate_env()

__all__ = ["TransformersTrainer"]
