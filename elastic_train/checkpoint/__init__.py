"""Checkpoints: what a report hands over (`Checkpoint`), how a run stores them (sharded files,
committed by a manifest written last, retried on transient storage errors), and how to list,
verify and load a run's committed checkpoints from outside it.

    checkpoint.py  the `Checkpoint` handle (a directory or a dict)
    manifest.py    the commit record: files with size and SHA-256, step, world size, metrics
    storage.py     a run's folder in any fsspec store
    retry.py       transient vs permanent storage errors, backoff with jitter
    catalog.py     list_checkpoints / verify_checkpoint / load_checkpoint
"""

from elastic_train.checkpoint.catalog import list_checkpoints, load_checkpoint, verify_checkpoint
from elastic_train.checkpoint.checkpoint import Checkpoint
from elastic_train.checkpoint.manifest import Manifest
from elastic_train.checkpoint.storage import CommittedCheckpoint, CorruptCheckpointError

__all__ = [
    "Checkpoint",
    "CommittedCheckpoint",
    "CorruptCheckpointError",
    "Manifest",
    "list_checkpoints",
    "load_checkpoint",
    "verify_checkpoint",
]
