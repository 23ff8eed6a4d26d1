"""The checkpoint folders of a run: which there are, which are committed and whole, and removing
them (retention, and the attempts a failed generation or a crash left behind).

A folder counts as committed only once its manifest is read back; one whose manifest is missing is
torn (never restored), one whose manifest is unreadable is skipped with a warning. A restore takes
the newest committed checkpoint whose files all verify. A removal takes the manifest first, so a
half-removed folder is never mistaken for a whole checkpoint, and leaves alone a folder this
process is committing (`guard.py`).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shutil
from typing import Any, Callable, Mapping

from elastic_train.checkpoint.checkpoint import is_local
from elastic_train.checkpoint.files import RunFiles
from elastic_train.checkpoint.guard import CommitGuard
from elastic_train.checkpoint.layout import Attempt, CommittedCheckpoint
from elastic_train.checkpoint.manifest import MANIFEST, Manifest
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.errors import StorageError

logger = logging.getLogger(__name__)


class CheckpointFolders(RunFiles):
    """The checkpoint folders of one run, to list, read back, verify and remove."""

    def __init__(self, storage_path: str, name: str, storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None, filesystem: Any = None):
        """As `RunFiles`; what this process commits or removes is its own (`CommitGuard`)."""
        super().__init__(storage_path, name, storage_options, retry, filesystem)
        self._guard = CommitGuard()

    def folder(self, attempt: Attempt) -> str:
        return posixpath.join(self.root, attempt.dirname)

    # -- reading --------------------------------------------------------------------------------
    def attempts(self) -> list[Attempt]:
        """Every checkpoint folder of the run, committed or not, in order."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.retry.call(f"listing {self.url()}", self.fs.ls, self.root, detail=True)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return []
            raise
        found = set()
        for entry in entries:
            folder = posixpath.basename(entry["name"].rstrip("/"))
            attempt = Attempt.parse(folder)
            if attempt is None and entry.get("type") == "directory" and not folder.startswith("."):
                attempt = self._named(folder)
            if attempt is not None:
                found.add(attempt)
        return sorted(found)

    def _named(self, folder: str) -> Attempt | None:
        """The attempt a folder named by a report holds, known by its manifest; None without one."""
        raw = self._read(posixpath.join(self.root, folder, MANIFEST))
        if raw is None:
            return None
        try:
            manifest = Manifest.from_json(raw.decode())
        except (ValueError, TypeError, KeyError):
            return None
        return Attempt(manifest.step, manifest.generation, folder)

    def committed(self, index: int | None = None) -> list[CommittedCheckpoint]:
        """Committed checkpoints of this run (of `index` only, if given), oldest first (an unreadable
        manifest is skipped, with a warning)."""
        attempts = [a for a in self.attempts() if index is None or a.index == index]
        return [c for c in map(self._committed, attempts) if c is not None]

    def newest_committed(self) -> CommittedCheckpoint | None:
        """The newest committed checkpoint, reading manifests from the newest folder back only as far
        as needed (a run may hold thousands)."""
        return next((c for c in map(self._committed, reversed(self.attempts())) if c is not None), None)

    def _committed(self, attempt: Attempt) -> CommittedCheckpoint | None:
        """The attempt's checkpoint if its manifest commits it."""
        manifest_path = posixpath.join(self.folder(attempt), MANIFEST)
        raw = self._read(manifest_path)
        if raw is None:
            return None
        try:
            manifest = Manifest.from_json(raw.decode())
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("skipping %s: its manifest %s is unreadable (%s)", attempt.dirname, manifest_path, exc)
            return None
        return CommittedCheckpoint(attempt.index, self.url(attempt.dirname), manifest, attempt.generation,
                                   attempt.name or None)

    def read_verified(self, checkpoint: CommittedCheckpoint) -> dict[str, bytes]:
        """The files of a committed checkpoint, each checked against the manifest."""
        return checkpoint.manifest.verified_files(self._reader(checkpoint), checkpoint.path)

    def verify(self, checkpoint: CommittedCheckpoint) -> list[str]:
        """Every problem of a committed checkpoint's files (empty when it is whole)."""
        return [f"{checkpoint.path}/{problem}" for _, _, problem in checkpoint.manifest.checked(self._reader(checkpoint))
                if problem is not None]

    def _reader(self, checkpoint: CommittedCheckpoint) -> Callable[[str], bytes | None]:
        """Reads a file of `checkpoint` by name; None when it is missing."""
        folder = self.folder(checkpoint.attempt)
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
    def delete(self, attempt: Attempt, keep: Callable[[Attempt], bool] | None = None) -> bool:
        """Remove the folder of `attempt`, unless this process is committing it, or `keep(attempt)`
        says otherwise (asked once the folder is claimed for removal, so a commit that ends before
        then is seen by it). The manifest goes first, so a half-deleted folder is never mistaken for
        a whole checkpoint. True if it was removed."""
        if not self._guard.begin_removal(attempt):
            logger.info("not removing %s: this process is committing or removing it", self.url(attempt.dirname))
            return False
        try:
            if keep is not None and keep(attempt):
                return False
            folder = self.folder(attempt)
            manifest = posixpath.join(folder, MANIFEST)
            if self.retry.call(f"checking {manifest}", self.fs.exists, manifest):
                self._remove(manifest)
            if is_local(self.fs):
                # A writer still busy may put a file back meanwhile: that one is left for a later sweep.
                shutil.rmtree(folder, ignore_errors=True)
            else:
                for path in self._find(folder):
                    self._remove(path)
                self._remove_empty_folder(folder)
            return True
        finally:
            self._guard.end_removal(attempt)

    def _remove_empty_folder(self, folder: str) -> None:
        """A filesystem with folders (a disk under a pyarrow or fsspec wrapper) keeps the emptied folder;
        an object store has none left."""
        with contextlib.suppress(OSError):
            if self.fs.isdir(folder) and not self.fs.ls(folder, detail=False):
                self.fs.rmdir(folder)

    def sweep(self, keep: Callable[[Attempt], bool]) -> list[Attempt]:
        """Remove every checkpoint folder that `keep` does not keep and no commit of this process is
        under way in; returns those removed."""
        return [attempt for attempt in self.attempts() if self.delete(attempt, keep)]
