"""A run's folder in any fsspec store: checkpoint files, commit manifests, retention.

Layout: `<storage_path>/<name>/checkpoint_<index>/<files>` plus `manifest.json`, written last. A
checkpoint exists only once its manifest is there; folders without one are torn and never restored.
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass, field
from typing import Any, Mapping

from fsspec.core import url_to_fs

from elastic_train.checkpoint import Checkpoint, is_local

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass
class CommittedCheckpoint:
    index: int
    path: str  # URL of the checkpoint folder
    metrics: dict[str, Any]
    loader_states: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_dirname(index: int) -> str:
    return f"checkpoint_{index:06d}"


class RunStorage:
    """The folder of one run. Picklable: workers and the supervisor each build their own."""

    def __init__(self, storage_path: str, name: str, storage_options: Mapping[str, Any] | None = None):
        self.storage_path = storage_path
        self.name = name
        self.storage_options = dict(storage_options or {})
        self.fs, root = url_to_fs(storage_path, **self.storage_options)
        self.root = posixpath.join(root.rstrip("/"), name)
        self.fs.makedirs(self.root, exist_ok=True)

    def url(self, *parts: str) -> str:
        path = posixpath.join(self.root, *parts)
        return path if is_local(self.fs) else self.fs.unstrip_protocol(path)

    def write_files(self, index: int, files: Mapping[str, bytes], writer: str) -> None:
        """Write a rank's part of checkpoint `index`; each file lands whole under its own name."""
        folder = posixpath.join(self.root, checkpoint_dirname(index))
        for name, data in files.items():
            target = posixpath.join(folder, name)
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            staging = f"{target}.{writer}.tmp"
            with self.fs.open(staging, "wb") as f:
                f.write(data)
            self.fs.mv(staging, target)

    def commit(self, index: int, manifest: dict[str, Any]) -> CommittedCheckpoint:
        """Make checkpoint `index` exist: drop files its manifest does not list (left by an abandoned
        attempt at the same index), then write the manifest, last."""
        folder = posixpath.join(self.root, checkpoint_dirname(index))
        listed = {posixpath.join(folder, name) for name in manifest["files"]}
        for path in self.fs.find(folder):
            if path not in listed:
                self.fs.rm(path)
        with self.fs.open(posixpath.join(folder, MANIFEST), "w") as f:
            json.dump(manifest, f, default=str)
        return _from_manifest(self.url(checkpoint_dirname(index)), manifest)

    def committed(self) -> list[CommittedCheckpoint]:
        """Committed checkpoints of this run, oldest first."""
        found = []
        for manifest_path in self.fs.glob(posixpath.join(self.root, "checkpoint_*", MANIFEST)):
            with self.fs.open(manifest_path, "r") as f:
                manifest = json.load(f)
            found.append(_from_manifest(self.url(posixpath.basename(posixpath.dirname(manifest_path))), manifest))
        return sorted(found, key=lambda c: c.index)

    def delete(self, index: int) -> None:
        folder = posixpath.join(self.root, checkpoint_dirname(index))
        # The manifest goes first, so a half-deleted folder is never mistaken for a whole checkpoint.
        self.fs.rm(posixpath.join(folder, MANIFEST))
        self.fs.rm(folder, recursive=True)

    def write_text(self, name: str, text: str) -> None:
        with self.fs.open(posixpath.join(self.root, name), "w") as f:
            f.write(text)


def _from_manifest(url: str, manifest: dict[str, Any]) -> CommittedCheckpoint:
    return CommittedCheckpoint(manifest["index"], url, manifest.get("metrics", {}), manifest.get("loader_states", []))


def open_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    fs, path = url_to_fs(url, **dict(storage_options or {}))
    return Checkpoint(path, fs)


__all__ = ["RunStorage", "CommittedCheckpoint", "open_checkpoint", "checkpoint_dirname"]
