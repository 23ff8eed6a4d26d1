"""`TrainContext`: where a worker stands, as the loop sees it (Ray Train's `get_context()`)."""

from __future__ import annotations

import hashlib
import os
import posixpath
import sys
from dataclasses import dataclass, field
from typing import Any

import fsspec

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.constants import working_dirs_root
from elastic_train.faithful.reads import record
from elastic_train.protocol import Assignment
from elastic_train.run_spec import RunInfo


@dataclass(frozen=True)
class StorageContext:
    """Where the run's files live (Ray Train's `get_context().get_storage()`), with Ray's attributes.

    Paths named `*_fs_path` are paths on `storage_filesystem`, without the URL's protocol, as in
    Ray. `storage_filesystem` is an fsspec filesystem (Ray's is a pyarrow one): `open`, `makedirs`,
    `ls`, ... work on those paths, and `storage_filesystem.unstrip_protocol(path)` gives the URL
    that fsspec-based writers (e.g. `torch.distributed.checkpoint`'s `FsspecWriter`) take.
    """

    storage_path: str  # RunConfig.storage_path, resolved (the default folder when it was None)
    experiment_dir_name: str  # the run's name: its folder under storage_path
    storage_filesystem: fsspec.AbstractFileSystem
    storage_fs_path: str

    @classmethod
    def of(cls, storage: RunStorage) -> "StorageContext":
        return cls(storage.storage_path, storage.name, storage.fs, posixpath.dirname(storage.root))

    @property
    def experiment_fs_path(self) -> str:
        """The run's folder on `storage_filesystem`: every checkpoint folder of the run is under it."""
        return posixpath.join(self.storage_fs_path, self.experiment_dir_name)

    def build_checkpoint_path_from_name(self, checkpoint_name: str) -> str:
        """The folder, on `storage_filesystem`, of the checkpoint named `checkpoint_name`: where a loop
        writes a checkpoint itself before `report(..., checkpoint_dir_name=checkpoint_name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)` registers it: a folder directly
        under the run's folder (committed checkpoints are listed there)."""
        if not checkpoint_name or "/" in checkpoint_name or checkpoint_name in (".", ".."):
            raise ValueError(
                f"checkpoint name {checkpoint_name!r}: use a folder name directly under the run's folder, "
                "e.g. 'epoch_3' (no '/')."
            )
        return posixpath.join(self.experiment_fs_path, checkpoint_name)

    def extract_checkpoint_dir_name_from_path(self, checkpoint_path: str) -> str:
        """The checkpoint name of a path under the run's folder (the inverse of the above)."""
        prefix = self.experiment_fs_path.rstrip("/") + "/"
        if not checkpoint_path.startswith(prefix):
            raise ValueError(f"checkpoint path {checkpoint_path} is not under the run's folder {self.experiment_fs_path}.")
        return checkpoint_path[len(prefix):]


@dataclass
class TrainContext:
    """Where this worker stands (Ray Train's `get_context()`)."""

    assignment: Assignment
    run: RunInfo
    storage: RunStorage

    # The place's reads are the loop's (faithful/reads.py): a recovery that changes one it holds re-enters it.
    def get_world_rank(self) -> int:
        return self._read("rank", self.assignment.rank)

    def get_world_size(self) -> int:
        return self._read("world_size", self.assignment.world_size)

    def get_local_rank(self) -> int:
        return self._read("local_rank", self.assignment.local_rank)

    def get_local_world_size(self) -> int:
        return self._read("local_world_size", self.assignment.local_world_size)

    def get_node_rank(self) -> int:
        return self._read("node_rank", self.assignment.node_rank)

    @staticmethod
    def _read(what: str, value: int) -> int:
        record(what, value, sys._getframe(2))
        return value

    def get_generation(self) -> int:
        """The membership generation: it grows by one at every change of the worker set."""
        return self.assignment.generation

    def get_resume_index(self) -> int:
        """How many reports the run's loop had made when this generation resumed from them (0 in a
        fresh run): with one report per step, the steps done. A loop that counts its own steps and
        keeps its state live (`prepare_model(model, live_state=True)`) goes on from here."""
        resume = self.assignment.resume
        return resume.index if resume is not None else 0

    def get_experiment_name(self) -> str:
        return self.run.name

    def get_trial_dir(self) -> str:
        """The run's folder (a local path, or a URL such as s3://bucket/prefix/<run>)."""
        return self.storage.url()

    def get_trial_name(self) -> str:
        """The Ray Tune trial's name when the run is a Tune trial's; outside Tune, the run's name (the
        run is then the trial, as `get_trial_dir` is its folder)."""
        return self.run.trial_name or self.run.name

    def get_trial_id(self) -> str | None:
        """The Ray Tune trial's id when the run is a Tune trial's; None outside Tune (no id is made
        up, so `get_trial_id() is None` tells whether the loop runs under Tune)."""
        return self.run.trial_id

    def get_trial_resources(self) -> Any:
        """Not available: a run's workers are placed beside the trial's driver, not inside the trial's
        resources, so the trial's placement group says nothing about the worker's."""
        raise NotImplementedError(
            "get_context().get_trial_resources() is not available in elastic_train: workers are placed beside "
            "the Tune trial's driver, not in its placement group. Use get_context().get_world_size() and the run's "
            "ScalingConfig (resources_per_worker) instead."
        )

    def get_metadata(self) -> dict[str, Any]:
        """The metadata passed to `TorchTrainer(metadata=...)` (empty when none was)."""
        return dict(self.run.metadata)

    def get_storage(self) -> StorageContext:
        """The run's storage: filesystem and paths (see `StorageContext`)."""
        return StorageContext.of(self.storage)

    def working_dir(self) -> str:
        """The run's working directory on this machine, the loop's current directory (as Ray Train
        sets it for every worker), shared by the run's workers there: relative paths such as
        Lightning's `lightning_logs/` or `TrainingArguments(output_dir="./output")` are the run's own,
        and two runs on one machine do not write into each other's. `<tmp>/elastic_train/working_dirs/
        <run name>_<hash of the run's storage folder>` (the hash tells apart runs of one name stored
        elsewhere)."""
        digest = hashlib.sha1(self.get_trial_dir().encode()).hexdigest()[:8]
        path = os.path.join(working_dirs_root(), f"{self.run.name}_{digest}")
        os.makedirs(path, exist_ok=True)
        return path
