"""The functions a training loop calls (Ray Train's `ray.train.*`)."""

from __future__ import annotations

from typing import Any

from elastic_train.checkpoint import Checkpoint
from elastic_train.worker.context import TrainContext
from elastic_train.worker.session import get_session


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Report this step's metrics, and optionally a checkpoint. Every rank calls it, every step alike.

    Returns once the checkpoint is snapshotted in memory; persisting it to storage goes on in the
    background. When the workers are about to be re-formed (a worker joined or was lost), this call
    does not return: the loop is re-entered at the new world size from the newest checkpoint.
    """
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) needs a dict, got {type(metrics).__name__}.")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) needs an elastic_train.Checkpoint, got {type(checkpoint).__name__}.")
    get_session("report").report(metrics, checkpoint)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the newest one a survivor holds in memory, else the newest
    committed one in storage, else None on a fresh start."""
    return get_session("get_checkpoint").get_checkpoint()


def get_context() -> TrainContext:
    """This worker's rank, world size, node rank and generation."""
    return get_session("get_context").context
