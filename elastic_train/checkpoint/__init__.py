"""Checkpoints: what a report hands over (`Checkpoint`), how a run stores them (sharded files,
committed by a manifest written last, retried on transient storage errors), and how to list,
verify and load a run's committed checkpoints from outside it.

    checkpoint.py   the `Checkpoint` handle (a directory or a dict)
    modes.py        how report() stores a checkpoint (CheckpointUploadMode, ...)
    manifest.py     the commit record: files with size and checksum, step, world size, metrics
    layout.py       a folder per attempt at a checkpoint (`Attempt`), `CommittedCheckpoint`
    filesystems.py  opening storage: fsspec URLs, pyarrow filesystems and pyarrow-style URIs
    retry.py        transient vs permanent storage errors, backoff with jitter
    files.py        `RunFiles`: a run's folder file by file, each written whole, retried
    folders.py      `CheckpointFolders(RunFiles)`: list, read back, verify, remove checkpoint folders
    guard.py        `CommitGuard`: within a process, no folder is removed while it is committed
    storage.py      `RunStorage(CheckpointFolders)`: write parts, commit them with their manifest
    catalog.py      list_checkpoints / verify_checkpoint / load_checkpoint
"""

from elastic_train.checkpoint.catalog import list_checkpoints, load_checkpoint, verify_checkpoint
from elastic_train.checkpoint.checkpoint import Checkpoint
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.manifest import CorruptCheckpointError, Manifest

__all__ = [
    "Checkpoint",
    "CommittedCheckpoint",
    "CorruptCheckpointError",
    "Manifest",
    "list_checkpoints",
    "load_checkpoint",
    "verify_checkpoint",
]
