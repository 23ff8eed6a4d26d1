"""The functions a training loop calls (Ray Train's `ray.train.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from elastic_train.checkpoint import Checkpoint
from elastic_train.checkpoint.modes import CheckpointConsistencyMode, CheckpointUploadMode, ReportedCheckpointStatus
from elastic_train.protocol import PreemptionInfo
from elastic_train.worker.loop.context import TrainContext
from elastic_train.worker.loop.current import get_session


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: CheckpointUploadMode | None = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None,
    validation: Any = False,
) -> None:
    """Report this step's metrics, and optionally a checkpoint. Every rank calls it, every step alike
    (it is a barrier across ranks, as in Ray Train).

    Every reported checkpoint is stored, in order, unless `CheckpointConfig` asks for a cadence. By
    default (ASYNC) this returns once the checkpoint is held in memory and stores it in the
    background; SYNC returns once it is committed in storage; NO_UPLOAD registers a checkpoint the
    loop wrote into the run's folder itself (see `CheckpointUploadMode`). `checkpoint_dir_name`
    names its folder in the run's folder. `delete_local_checkpoint_after_upload` removes the
    reported local folder once it is held (default: only with an explicit ASYNC, as in Ray).
    `checkpoint_upload_fn(checkpoint, dir_name) -> Checkpoint` stores it the user's way (into
    `get_context().get_storage().build_checkpoint_path_from_name(dir_name)`); the checkpoint it
    returns is registered as with NO_UPLOAD.

    When the workers are about to be re-formed (a worker joined or was lost), this call does not
    return: the loop is re-entered at the new world size from the newest checkpoint.
    """
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics) needs a dict, got {type(metrics).__name__}.")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint.from_ray(checkpoint)
    if validation:
        raise NotImplementedError(
            "report(validation=...) is not supported by elastic_train: validate in the loop (or in a "
            "RunConfig callback's after_report) and report the result as a metric.")
    if checkpoint_upload_mode is not None and not isinstance(checkpoint_upload_mode, CheckpointUploadMode):
        raise TypeError("report(checkpoint_upload_mode=...) takes an elastic_train.CheckpointUploadMode, got "
                        f"{checkpoint_upload_mode!r}.")
    if checkpoint_dir_name is not None and (not checkpoint_dir_name or "/" in checkpoint_dir_name
                                            or checkpoint_dir_name.startswith(".")):
        raise ValueError(f"report(checkpoint_dir_name={checkpoint_dir_name!r}): use a folder name without '/' "
                         "that does not start with '.'.")
    mode = checkpoint_upload_mode or CheckpointUploadMode.ASYNC
    if delete_local_checkpoint_after_upload is None:
        delete_local_checkpoint_after_upload = checkpoint_upload_mode is CheckpointUploadMode.ASYNC
    get_session("report").report(metrics, checkpoint, dir_name=checkpoint_dir_name, mode=mode,
                                 delete_local=delete_local_checkpoint_after_upload, upload_fn=checkpoint_upload_fn)


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint to resume from: the newest one a survivor holds in memory, else the newest
    committed one in storage, else None on a fresh start."""
    return get_session("get_checkpoint").get_checkpoint()


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """This rank's share of `TorchTrainer(datasets={dataset_name: ...})`, a `ray.data.DataIterator`
    (None where the trainer has no datasets). Each walk of its `iter_batches` / `iter_torch_batches`
    is one epoch, every row once across resizes (ingest/shard.py); a dataset not in
    `DataConfig(datasets_to_split=...)` is Ray's own iterator over all of it."""
    return get_session("get_dataset_shard").dataset_shard(dataset_name)


def get_context() -> TrainContext:
    """This worker's rank, world size, node rank and generation."""
    return get_session("get_context").context


@dataclass
class ReportedCheckpoint:
    """A committed checkpoint and the metrics reported with it (Ray Train's; always committed here,
    as elastic_train has no validation step)."""

    checkpoint: Checkpoint
    metrics: dict[str, Any]
    status: ReportedCheckpointStatus = ReportedCheckpointStatus.COMMITTED


def get_all_reported_checkpoints(consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
                                 timeout_s: float | None = None) -> list[ReportedCheckpoint]:
    """Every checkpoint of the run committed so far, oldest first, with its metrics. Waits until the
    checkpoints this worker reported have settled (committed, or given up). `consistency_mode` is
    accepted for Ray's signature: without validation, committed is all there is."""
    session = get_session("get_all_reported_checkpoints")
    return [ReportedCheckpoint(c, m) for c, m in session.reported_checkpoints(timeout_s)]


def get_preemption_info() -> PreemptionInfo | None:
    """The imminent preemption of a node running this run's workers, once one is known; else None.

    Every rank gets the same answer: like `report()`, this is a barrier, so every rank must call it
    the same number of times. The recommended reaction (as in Ray Train) is to report a checkpoint
    at once; elastic_train then re-forms the group without the preempted workers right after that
    report, so no step is redone.
    """
    return get_session("get_preemption_info").preemption_info()
