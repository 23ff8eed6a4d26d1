"""List, verify and load a run's committed checkpoints from outside the run (evaluation, export,
inspection after a crash). A run is named by its folder, `Result.path`: `<storage_path>/<name>`."""

from __future__ import annotations

from typing import Any, Mapping

from elastic_train.checkpoint.checkpoint import Checkpoint
from elastic_train.checkpoint.folders import CheckpointFolders
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.errors import CheckpointError


def list_checkpoints(run_path: str, storage_options: Mapping[str, Any] | None = None) -> list[CommittedCheckpoint]:
    """The run's committed checkpoints, oldest first (by index, then generation: each generation's
    attempt at a checkpoint has a folder of its own, `checkpoint_<index>_g<generation>`); each with
    its manifest (step, world size, generation, metrics, files with sizes and checksums). Torn ones
    (no manifest) are not listed."""
    return CheckpointFolders.at(run_path, storage_options).committed()


def verify_checkpoint(
    run_path: str, index: int | None = None, storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """What is wrong with checkpoint `index` (default: the newest committed; of an index committed
    by more than one generation, the newest generation's); empty when it is whole."""
    storage = CheckpointFolders.at(run_path, storage_options)
    return storage.verify(_pick(storage, index))


def load_checkpoint(
    run_path: str, index: int | None = None, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Checkpoint `index`, or by default the newest one whose files all verify (a corrupt newer one
    is skipped with a warning naming the bad file). Reading it checks every file again."""
    storage = CheckpointFolders.at(run_path, storage_options)
    if index is None:
        whole, _ = storage.newest_whole(storage.committed())
        if whole is None:
            raise CheckpointError(f"{run_path} holds no whole committed checkpoint.")
        chosen = whole
    else:
        chosen = _pick(storage, index)
    return Checkpoint(storage.folder(chosen.attempt), storage.fs, chosen.manifest)


def _pick(storage: CheckpointFolders, index: int | None) -> CommittedCheckpoint:
    """Checkpoint `index` (the newest generation's, if more than one committed it), or the newest;
    reads only the manifests it needs."""
    chosen = storage.newest_committed() if index is None else (storage.committed(index) or [None])[-1]
    if chosen is not None:
        return chosen
    if index is None:
        raise CheckpointError(f"{storage.url()} holds no committed checkpoint.")
    raise CheckpointError(
        f"{storage.url()} has no committed checkpoint {index}; committed: {[c.index for c in storage.committed()]}."
    )
