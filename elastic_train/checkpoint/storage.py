"""A run's folder in any fsspec store: checkpoint parts, commit manifests, retention, clean-up.

Layout: `<storage_path>/<name>/checkpoint_<index>/<files, as the user named them>` plus the
manifest (`manifest.py`), written last. Every file is an object of its own, written whole in one
call (`pipe_file`: one PUT, or a multipart upload that only appears once complete), so there is no
rename step that an object store would turn into a second copy. Every call is retried on
transient errors (`retry.py`).
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fsspec.core import url_to_fs

from elastic_train.checkpoint.checkpoint import is_local
from elastic_train.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest, file_facts
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.errors import ConfigError, StorageError

logger = logging.getLogger(__name__)

_FOLDER = re.compile(r"checkpoint_(\d+)$")


@dataclass
class CommittedCheckpoint:
    index: int
    path: str  # URL of the checkpoint folder
    manifest: Manifest

    @property
    def metrics(self) -> dict[str, Any]:
        return self.manifest.metrics

    @property
    def loader_states(self) -> list[dict[str, Any]]:
        return self.manifest.loader_states


def checkpoint_dirname(index: int) -> str:
    return f"checkpoint_{index:06d}"


def open_filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """`url_to_fs`, with a clear error when the protocol's fsspec backend is not installed."""
    try:
        return url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:
        raise ConfigError(f"storage_path {url!r} needs a filesystem that is not installed: {exc}") from exc


class RunStorage:
    """The folder of one run. Picklable: workers and the supervisor each build their own."""

    def __init__(
        self,
        storage_path: str,
        name: str,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
    ):
        self.storage_path = storage_path
        self.name = name
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self.fs, root = open_filesystem(storage_path, self.storage_options)
        self.root = posixpath.join(root.rstrip("/"), name)

    @classmethod
    def at(cls, run_path: str, storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> "RunStorage":
        """The storage of the run whose folder is `run_path` (a `Result.path`)."""
        parent, _, name = str(run_path).rstrip("/").rpartition("/")
        if not parent or not name:
            raise ConfigError(f"{run_path!r} is not a run folder: expected <storage_path>/<run name>.")
        return cls(parent, name, storage_options, **kwargs)

    @property
    def process_local(self) -> bool:
        """True for stores that only the process that made them can see (memory://)."""
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        return "memory" in protocols

    def url(self, *parts: str) -> str:
        path = posixpath.join(self.root, *parts)
        return path if is_local(self.fs) else self.fs.unstrip_protocol(path)

    def folder(self, index: int) -> str:
        return posixpath.join(self.root, checkpoint_dirname(index))

    # -- set-up ---------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Create the run's folder and write and remove a probe object: wrong credentials or a
        missing bucket fail here, before any actor starts."""
        probe = posixpath.join(self.root, f".probe-{uuid.uuid4().hex}")
        self.retry.call(f"creating {self.url()}", self.fs.makedirs, self.root, exist_ok=True)
        self.retry.call(f"writing to {self.url()}", self.fs.pipe_file, probe, b"")
        self.retry.call(f"deleting from {self.url()}", self.fs.rm, probe)

    # -- writing --------------------------------------------------------------------------------
    def write_part(self, index: int, files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
        """Store a rank's part of checkpoint `index`; returns each file's size and checksum."""
        facts = file_facts(files)
        for name, data in files.items():
            target = posixpath.join(self.folder(index), name)
            if is_local(self.fs):
                self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.retry.call(f"writing {self.url(checkpoint_dirname(index), name)}", self.fs.pipe_file, target, data)
        return facts

    def commit(self, index: int, manifest: Manifest) -> CommittedCheckpoint:
        """Make checkpoint `index` exist: drop files its manifest does not list (left by an abandoned
        attempt at the same index), then write the manifest, last."""
        folder = self.folder(index)
        listed = {posixpath.join(folder, name) for name in manifest.files}
        for path in self._find(folder):
            if path not in listed:
                self.retry.call(f"deleting {path}", self.fs.rm, path)
        self.retry.call(f"committing {self.url(checkpoint_dirname(index))}", self.fs.pipe_file,
                        posixpath.join(folder, MANIFEST), manifest.to_json().encode())
        return CommittedCheckpoint(index, self.url(checkpoint_dirname(index)), manifest)

    def write_text(self, name: str, text: str) -> None:
        self.retry.call(f"writing {self.url(name)}", self.fs.pipe_file, posixpath.join(self.root, name), text.encode())

    # -- reading --------------------------------------------------------------------------------
    def indices(self) -> list[int]:
        """Every checkpoint folder of the run, committed or not."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.retry.call(f"listing {self.url()}", self.fs.ls, self.root, detail=False)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return []
            raise
        found = (_FOLDER.match(posixpath.basename(e.rstrip("/"))) for e in entries)
        return sorted(int(m.group(1)) for m in found if m)

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints of this run, oldest first (an unreadable manifest is skipped, with a warning)."""
        found = []
        for index in self.indices():
            manifest_path = posixpath.join(self.folder(index), MANIFEST)
            raw = self._read(manifest_path)
            if raw is None:
                continue
            try:
                manifest = Manifest.from_json(raw.decode())
            except (ValueError, TypeError, KeyError) as exc:
                logger.warning("skipping %s: its manifest %s is unreadable (%s)", checkpoint_dirname(index),
                               manifest_path, exc)
                continue
            found.append(CommittedCheckpoint(index, self.url(checkpoint_dirname(index)), manifest))
        return found

    def read_verified(self, checkpoint: CommittedCheckpoint) -> dict[str, bytes]:
        """The files of a committed checkpoint, each checked against the manifest."""
        return checkpoint.manifest.verified_files(self._reader(checkpoint), checkpoint.path)

    def verify(self, checkpoint: CommittedCheckpoint) -> list[str]:
        """Every problem of a committed checkpoint's files (empty when it is whole)."""
        return [f"{checkpoint.path}/{problem}" for _, _, problem in checkpoint.manifest.checked(self._reader(checkpoint))
                if problem is not None]

    def _reader(self, checkpoint: CommittedCheckpoint) -> Callable[[str], bytes | None]:
        """Reads a file of `checkpoint` by name; None when it is missing."""
        folder = self.folder(checkpoint.index)
        return lambda name: self._read(posixpath.join(folder, name))

    def newest_whole(
        self, checkpoints: list[CommittedCheckpoint]
    ) -> tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, list[str]]]]:
        """The newest of `checkpoints` whose files all verify, and the newer ones that did not, with
        what is wrong with each (also logged)."""
        corrupt = []
        for checkpoint in reversed(checkpoints):
            problems = self.verify(checkpoint)
            if not problems:
                return checkpoint, corrupt
            logger.warning("checkpoint %s is corrupt, skipped: %s", checkpoint.path, "; ".join(problems))
            corrupt.append((checkpoint, problems))
        return None, corrupt

    # -- removing -------------------------------------------------------------------------------
    def delete(self, index: int) -> None:
        """Remove checkpoint `index`; the manifest goes first, so a half-deleted folder is never
        mistaken for a whole checkpoint."""
        folder = self.folder(index)
        manifest = posixpath.join(folder, MANIFEST)
        if self.retry.call(f"checking {manifest}", self.fs.exists, manifest):
            self.retry.call(f"deleting {manifest}", self.fs.rm, manifest)
        for path in self._find(folder):
            self.retry.call(f"deleting {path}", self.fs.rm, path)
        if is_local(self.fs) and self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)

    def _find(self, folder: str) -> list[str]:
        self.fs.invalidate_cache(folder)
        return self.retry.call(f"listing {folder}", self.fs.find, folder)

    def _read(self, path: str) -> bytes | None:
        try:
            return self.retry.call(f"reading {path}", self.fs.cat_file, path)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise


__all__ = ["RunStorage", "CommittedCheckpoint", "CorruptCheckpointError", "checkpoint_dirname", "open_filesystem"]
