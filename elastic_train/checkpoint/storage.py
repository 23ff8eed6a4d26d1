"""Writing a run's checkpoints: each rank's part into its attempt's folder, then the commit.

A part is stored file by file (`files.py`) into the folder of its generation's attempt
(`layout.py`). The commit first checks the stored objects' sizes against the facts the writers
reported (one listing, no re-read): a manifest is never written over files that do not match it.
It then writes the manifest, last: only then does the checkpoint exist (`folders.py` lists it).
Within one process (the supervisor's), a folder being committed is never removed, and a folder
being removed is never committed (`guard.py`).
"""

from __future__ import annotations

import contextlib
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping

from elastic_train.checkpoint.files import is_scratch
from elastic_train.checkpoint.folders import CheckpointFolders
from elastic_train.checkpoint.layout import Attempt, CommittedCheckpoint
from elastic_train.checkpoint.manifest import CHECKSUM, MANIFEST, Manifest, checked_facts, new_digest
from elastic_train.errors import CheckpointError

_READ_CHUNK = 8 << 20  # bytes read at a time when checksumming a stored file
# A part at least this large is checked against its facts while it is written (the write releases the
# GIL): hashing first held a 64 MB save to 0.81 of a raw copy here. A smaller one is checked first.
CHECKED_WHILE_WRITTEN_BYTES = 4 << 20
_CHECKING = ThreadPoolExecutor(max_workers=4, thread_name_prefix="elastic-check")


class CommitRefused(CheckpointError):
    """A checkpoint was not committed: its stored files do not match what its writers reported, or
    its folder is being removed. Nothing was written; the next checkpoint will be tried."""


class RunStorage(CheckpointFolders):
    """The folder of one run: its files, its checkpoint folders, and writing and committing
    checkpoints into it. Picklable: workers and the supervisor each build their own (what is being
    committed or removed is known to the process that does it, and is not pickled)."""

    def write_part(self, index: int, files: Mapping[str, bytes], generation: int = 0, name: str | None = None,
                   facts: Mapping[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Store a rank's part of checkpoint `index`, as reported in `generation`, into that
        attempt's folder (or the one the report named); returns each file's size and checksum.
        `facts`: those the files were reported with; a file that no longer matches them (its copy in
        memory was corrupted since) raises `CorruptCheckpointError`, and nothing is stored."""
        attempt = Attempt(index, generation, name)
        where = f"part of checkpoint {index} (generation {generation}) held in memory"
        paths = {file: posixpath.join(self.folder(attempt), file) for file in files}
        if sum(len(data) for data in files.values()) < CHECKED_WHILE_WRITTEN_BYTES:
            facts = checked_facts(files, facts, where)
            self._put_files(attempt, files, paths)
            return facts
        checking = _CHECKING.submit(checked_facts, files, facts, where)  # hashes while the files are written
        try:
            self._put_files(attempt, files, paths)
        finally:
            checked = checking.exception()
        if checked is not None:  # the copy held is not the one reported: what was written of it goes
            for path in paths.values():
                self._remove(path)
            raise checked
        return checking.result()

    def _put_files(self, attempt: Attempt, files: Mapping[str, bytes], paths: Mapping[str, str]) -> None:
        for file, data in files.items():
            self._put(paths[file], data, f"writing {self.url(attempt.dirname, file)}")

    def commit(self, index: int, manifest: Manifest, name: str | None = None) -> CommittedCheckpoint:
        """Make checkpoint `index` of `manifest.generation` exist (in the folder `name`, if the
        report named one): check that every file the manifest lists is stored with its reported
        size, then write the manifest, last. Raises `CommitRefused` (and writes nothing) when a file
        is missing or of another size, or when the folder is being removed."""
        attempt = Attempt(index, manifest.generation, name)
        url = self.url(attempt.dirname)
        with self.committing(attempt):
            stored = self._stored_sizes(attempt)
            problems = []
            for file, facts in sorted(manifest.files.items()):
                size = stored.get(file)
                if size is None:
                    problems.append(f"{file} is not stored")
                elif size != facts["size"]:
                    problems.append(f"{file} is stored with {size} bytes, its writer reported {facts['size']}")
            if problems:
                raise CommitRefused(f"not committing {url}: {'; '.join(problems)}")
            self._put(posixpath.join(self.folder(attempt), MANIFEST), manifest.to_json().encode(), f"committing {url}")
        return CommittedCheckpoint(index, url, manifest, attempt.generation, attempt.name or None)

    def stored_facts(self, name: str) -> dict[str, dict[str, Any]]:
        """Size and checksum of every file under the folder `name` of the run (a checkpoint the
        loop wrote there itself): what its manifest will list. Reads every file once, streamed: a
        checkpoint of any size is never held in memory whole."""
        folder = posixpath.join(self.root, name)
        self.fs.invalidate_cache(folder)
        paths = self.retry.call(f"listing {self.url(name)}", self.fs.find, folder)
        prefix = self.fs._strip_protocol(folder).rstrip("/") + "/"
        facts = {}
        for path in paths:
            rel = self.fs._strip_protocol(path)[len(prefix):]
            if rel != MANIFEST and not is_scratch(posixpath.basename(rel)):
                facts[rel] = self.retry.call(f"reading {self.url(name, rel)}", self._streamed_facts, path)
        if not facts:
            raise CheckpointError(f"{self.url(name)} holds no file: write the checkpoint there before reporting it.")
        return facts

    def _streamed_facts(self, path: str) -> dict[str, Any]:
        digest, size = new_digest(), 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return {"size": size, CHECKSUM: digest.hexdigest()}

    def name_of(self, path: str) -> str:
        """The folder name, under this run's folder, of a checkpoint at `path`; a clear error for a
        path elsewhere."""
        stripped = self.fs._strip_protocol(str(path)).rstrip("/")
        root = self.fs._strip_protocol(self.root).rstrip("/")
        name = stripped[len(root) + 1:] if stripped.startswith(root + "/") else ""
        if not name or "/" in name:
            raise CheckpointError(
                f"checkpoint path {path!r} is not a folder directly under the run's folder {self.url()}: build it "
                "with get_context().get_storage().build_checkpoint_path_from_name(name), write the checkpoint "
                "there, then report it with checkpoint_upload_mode=NO_UPLOAD.")
        return name

    def _stored_sizes(self, attempt: Attempt) -> dict[str, int]:
        """The size of every object in an attempt's folder, by name: one listing."""
        folder = self.folder(attempt)
        self.fs.invalidate_cache(folder)
        listed = self.retry.call(f"listing {self.url(attempt.dirname)}", self.fs.find, folder, detail=True)
        prefix = self.fs._strip_protocol(folder).rstrip("/") + "/"
        sizes = {}
        for path, info in listed.items():
            path = self.fs._strip_protocol(path)
            if path.startswith(prefix) and info.get("size") is not None:
                sizes[path[len(prefix):]] = int(info["size"])
        return sizes

    # -- what this process commits ------------------------------------------------------------------
    def begin_commit(self, attempt: Attempt) -> None:
        """Mark `attempt` as being committed by this process: `delete` and `sweep` leave its folder
        alone until `end_commit`. Raises `CommitRefused` if the folder is being removed."""
        if not self._guard.begin_commit(attempt):
            raise CommitRefused(f"not committing {self.url(attempt.dirname)}: it is being removed")

    def end_commit(self, attempt: Attempt) -> None:
        """The commit of `attempt` that `begin_commit` marked is over (done or not)."""
        self._guard.end_commit(attempt)

    @contextlib.contextmanager
    def committing(self, attempt: Attempt) -> Iterator[None]:
        """`begin_commit` ... `end_commit` around a block."""
        self.begin_commit(attempt)
        try:
            yield
        finally:
            self.end_commit(attempt)

    def wait_for_commits(self, timeout_s: float) -> bool:
        """Wait until no commit of this process is under way; False if `timeout_s` passed first."""
        return self._guard.wait_for_commits(timeout_s)
