"""A reported checkpoint taken in: its folder name checked, the user's upload_fn run, and its files
read (or its dict held as live tensors) before the loop may change or delete them.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable

from elastic_train.checkpoint.checkpoint import Checkpoint, is_local
from elastic_train.checkpoint.layout import check_named_folder, checkpoint_dirname
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import CheckpointError
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.report.plan import Carries, ReportPlan

logger = logging.getLogger(__name__)


@dataclass
class TakenCheckpoint:
    """What a report holds of its checkpoint."""

    dir_name: str | None  # the folder its report names (the user's, or where NO_UPLOAD stored it)
    files: dict[str, bytes] | None = None  # Carries.FILES
    live: LivePart | None = None  # Carries.LIVE


def take(checkpoint: Checkpoint, plan: ReportPlan, storage: RunStorage, index: int, generation: int, *,
         dir_name: str | None, upload_fn: Callable[[Checkpoint, str], Checkpoint] | None,
         delete_local: bool) -> TakenCheckpoint:
    """Take in report `index`'s checkpoint as `plan` carries it."""
    if dir_name is not None:
        check_named_folder(dir_name, index, generation)
    if upload_fn is not None:  # the user's upload, into the run's folder; then registered as stored
        dir_name = dir_name or checkpoint_dirname(index, generation)
        checkpoint = upload_fn(checkpoint, dir_name)
    if plan.carries is Carries.LOOP_STORED:
        dir_name = storage.name_of(checkpoint.path)
        check_named_folder(dir_name, index, generation)
        return TakenCheckpoint(dir_name)
    if _overlap(checkpoint, storage) == "holds the run":
        raise CheckpointError(
            f"report(checkpoint=Checkpoint.from_directory({checkpoint.path!r})): that folder holds the "
            "run's own folder (get_context().get_trial_dir()), its record and its other checkpoints. "
            "Save into a folder of its own, e.g. tempfile.TemporaryDirectory(), and report that.")
    if plan.carries is Carries.LIVE:
        taken = TakenCheckpoint(dir_name, live=LivePart.of(checkpoint))
    else:
        taken = TakenCheckpoint(dir_name, files=checkpoint.files())
    if delete_local:
        _delete_local(checkpoint, storage)
    return taken


def _delete_local(checkpoint: Checkpoint, storage: RunStorage) -> None:
    """`delete_local_checkpoint_after_upload`: remove the reported local folder once it is held in
    memory. Never a folder in the run's storage, nor one holding it."""
    if checkpoint.manifest is not None or not checkpoint.path or not checkpoint.on_local_disk:
        return
    if _overlap(checkpoint, storage) is not None:
        logger.warning("not deleting %s after the report: it is in the run's storage", checkpoint.path)
        return
    shutil.rmtree(os.path.realpath(checkpoint.path), ignore_errors=True)


@functools.lru_cache(maxsize=16)
def _real(path: str) -> str:
    """The run's folder, resolved once: a report checks every checkpoint folder against it."""
    return os.path.realpath(path)


def _overlap(checkpoint: Checkpoint, storage: RunStorage) -> str | None:
    """How a reported local folder overlaps the run's local folder: "holds the run" (it is that
    folder, or one above it), "in the run", or None."""
    if not checkpoint.path or not checkpoint.on_local_disk or not is_local(storage.fs):
        return None
    folder, run = os.path.realpath(checkpoint.path), _real(storage.url())
    if folder == run or run.startswith(folder + os.sep):
        return "holds the run"
    return "in the run" if folder.startswith(run + os.sep) else None
