"""A run's folder in any fsspec store: checkpoint parts, commit manifests, retention, clean-up.

Layout: `<storage_path>/<name>/checkpoint_<index>_g<generation>/<files, as the user named them>`
plus the manifest (`manifest.py`), written last. A folder holds one generation's attempt at a
checkpoint (`Attempt`): after a failure the next generation reports the same indices again, while a
worker of the older one (fenced, or its persister still busy) may still be writing; with a folder
per attempt, such a stale writer can never touch files of a checkpoint another generation commits.

A report may name its folder instead (`report(checkpoint_dir_name=...)`, as in Ray Train, or a
checkpoint the loop wrote there itself with `NO_UPLOAD`). Such a folder is known by its manifest;
one without a manifest is never removed here (it may be the user's, half written), and a name used
again is written again: the newest commit under a name is the one it holds.

Every file is an object of its own, written whole in one call (`pipe_file`: one PUT, or a multipart
upload that only appears once complete), so there is no rename step that an object store would turn
into a second copy. A local file is written beside its name and renamed over it, so that it too is
never seen half written. Every call is retried on transient errors (`retry.py`).

A commit first checks the stored objects' sizes against the facts the writers reported (one
listing, no re-read): a manifest is never written over files that do not match it. Within one
process (the supervisor's), a folder being committed is never removed, and a folder being removed
is never committed (`begin_commit`, `delete`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import logging
import os
import posixpath
import re
import shutil
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from elastic_train.checkpoint.checkpoint import is_local
from elastic_train.checkpoint.filesystems import open_filesystem
from elastic_train.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest, checked_facts
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.errors import CheckpointError, ConfigError, StorageError

logger = logging.getLogger(__name__)

_FOLDER = re.compile(r"checkpoint_(\d+)(?:_g(\d+))?$")
_READ_CHUNK = 8 << 20  # bytes read at a time when checksumming a stored file
_SCRATCH = re.compile(r"\..+\.[0-9a-f]{12}\.tmp$")  # a local file being written (`_put_local`)
LEGACY_GENERATION = -1  # a folder named by index alone, as releases before attempts wrote them


@dataclass(frozen=True, order=True)
class Attempt:
    """One generation's attempt at storing checkpoint `index`: a folder of its own. Attempts sort
    by index, then generation, as their folder names do."""

    index: int
    generation: int
    name: str = ""  # a folder the report named ("": ours)

    def __post_init__(self) -> None:
        if self.name is None or self.name == self._own_dirname():  # one folder, one attempt, one key
            object.__setattr__(self, "name", "")

    @property
    def dirname(self) -> str:
        return self.name or self._own_dirname()

    def _own_dirname(self) -> str:
        if self.generation == LEGACY_GENERATION:
            return f"checkpoint_{self.index:06d}"
        return f"checkpoint_{self.index:06d}_g{self.generation:04d}"

    @classmethod
    def parse(cls, name: str) -> "Attempt | None":
        """The attempt a folder name stands for; None for a name that is not a checkpoint folder."""
        found = _FOLDER.match(name)
        if found is None:
            return None
        generation = found.group(2)
        return cls(int(found.group(1)), LEGACY_GENERATION if generation is None else int(generation))


@dataclass
class CommittedCheckpoint:
    index: int
    path: str  # URL of the checkpoint folder
    manifest: Manifest
    generation: int = LEGACY_GENERATION  # of the folder's name: the generation that committed it
    name: str | None = None  # the folder's name, when the report named it

    @property
    def attempt(self) -> Attempt:
        return Attempt(self.index, self.generation, self.name or "")

    @property
    def metrics(self) -> dict[str, Any]:
        return self.manifest.metrics

    @property
    def loader_states(self) -> list[dict[str, Any]]:
        return self.manifest.loader_states


class CommitRefused(CheckpointError):
    """A checkpoint was not committed: its stored files do not match what its writers reported, or
    its folder is being removed. Nothing was written; the next checkpoint will be tried."""


def checkpoint_dirname(index: int, generation: int) -> str:
    return Attempt(index, generation).dirname


def check_named_folder(name: str, index: int, generation: int) -> None:
    """A folder a report names must not pass for one of ours (`checkpoint_<index>[_g<generation>]`):
    it would be read back as another attempt, and swept or retained as such."""
    if _FOLDER.match(name) and name != checkpoint_dirname(index, generation):
        raise CheckpointError(
            f"checkpoint folder name {name!r}: names like checkpoint_<digits>[_g<digits>] are elastic_train's own "
            "folders; pick another, e.g. f'epoch_{epoch}'.")


def _run_mark(run_id: str) -> str:
    return f".fit-{run_id}"


class RunStorage:
    """The folder of one run. Picklable: workers and the supervisor each build their own (what is
    being committed or removed is known to the process that does it, and is not pickled)."""

    def __init__(
        self,
        storage_path: str,
        name: str,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        filesystem: Any = None,
    ):
        """`storage_path`: an fsspec URL (or local path), or a path on `filesystem` when one is given
        (`RunConfig(storage_filesystem=...)`, fsspec or pyarrow)."""
        self.storage_path = storage_path
        self.name = name
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        self.fs, root = open_filesystem(storage_path, self.storage_options, filesystem)
        self._on_given_fs = filesystem is not None  # paths are then the filesystem's own, with no protocol
        self.root = posixpath.join(root.rstrip("/"), name)
        self._init_guard()

    def _init_guard(self) -> None:
        self._guard = threading.Condition()
        self._committing: collections.Counter[Attempt] = collections.Counter()
        self._removing: set[Attempt] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for private in ("_guard", "_committing", "_removing"):
            state.pop(private, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_guard()

    @classmethod
    def at(cls, run_path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
           **kwargs: Any) -> "RunStorage":
        """The storage of the run whose folder is `run_path` (a `Result.path`; a pyarrow-style URI's
        query, if any, stays with the storage path)."""
        path, mark, query = str(run_path).partition("?") if "://" in str(run_path) else (str(run_path), "", "")
        parent, _, name = path.rstrip("/").rpartition("/")
        parent += mark + query
        if not parent or not name:
            raise ConfigError(f"{run_path!r} is not a run folder: expected <storage_path>/<run name>.")
        return cls(parent, name, storage_options, **kwargs)

    @property
    def process_local(self) -> bool:
        """True for stores that only the process that made them can see (memory://)."""
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        return "memory" in protocols

    def url(self, *parts: str) -> str:
        """Where `parts` are: a local path, a path on the filesystem the run was given, or a URL."""
        path = posixpath.join(self.root, *parts)
        return path if is_local(self.fs) or self._on_given_fs else self.fs.unstrip_protocol(path)

    def folder(self, attempt: Attempt) -> str:
        return posixpath.join(self.root, attempt.dirname)

    # -- set-up ---------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Create the run's folder and write and remove a probe object: wrong credentials or a
        missing bucket fail here, before any actor starts."""
        probe = posixpath.join(self.root, f".probe-{uuid.uuid4().hex}")
        self.retry.call(f"creating {self.url()}", self.fs.makedirs, self.root, exist_ok=True)
        self.retry.call(f"writing to {self.url()}", self.fs.pipe_file, probe, b"")
        self.retry.call(f"deleting from {self.url()}", self.fs.rm, probe)

    # -- writing --------------------------------------------------------------------------------
    def write_part(self, index: int, files: Mapping[str, bytes], generation: int = 0, name: str | None = None,
                   facts: Mapping[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Store a rank's part of checkpoint `index`, as reported in `generation`, into that
        attempt's folder (or the one the report named); returns each file's size and checksum.
        `facts`: those the files were reported with; a file that no longer matches them (its copy in
        memory was corrupted since) raises `CorruptCheckpointError`, and nothing is stored."""
        attempt = Attempt(index, generation, name)
        facts = checked_facts(files, facts, f"part of checkpoint {index} (generation {generation}) held in memory")
        for name, data in files.items():
            self._put(posixpath.join(self.folder(attempt), name), data,
                      f"writing {self.url(attempt.dirname, name)}")
        return facts

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
            if rel != MANIFEST and not _SCRATCH.match(posixpath.basename(rel)):
                facts[rel] = self.retry.call(f"reading {self.url(name, rel)}", self._streamed_facts, path)
        if not facts:
            raise CheckpointError(f"{self.url(name)} holds no file: write the checkpoint there before reporting it.")
        return facts

    def _streamed_facts(self, path: str) -> dict[str, Any]:
        digest, size = hashlib.sha256(), 0
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        return {"size": size, "sha256": digest.hexdigest()}

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

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a file of the run's folder (not a checkpoint) whole."""
        self._put(posixpath.join(self.root, name), data, f"writing {self.url(name)}")

    # -- a local storage_path must be one folder on every machine --------------------------------
    def mark_run(self, run_id: str) -> None:
        """On local storage, leave a file named after this `fit()` in the run's folder: a worker whose
        machine has a disk of its own at that path does not find it (`sees_run`). Object stores are
        shared by nature."""
        if is_local(self.fs):
            self.write_bytes(_run_mark(run_id), b"")

    def sees_run(self, run_id: str) -> bool:
        """Whether this process sees the mark of `fit()` `run_id` (always, on object stores; and when
        the mark cannot be read: only a folder known to lack it tells an unshared disk)."""
        if not is_local(self.fs):
            return True
        try:
            return self.read(_run_mark(run_id)) is not None
        except StorageError:
            return True

    def unmark_run(self, run_id: str) -> None:
        if is_local(self.fs):
            with contextlib.suppress(OSError):
                os.remove(posixpath.join(self.root, _run_mark(run_id)))

    @property
    def appends(self) -> bool:
        """Whether `append_bytes` works here: local storage appends; object stores only write whole."""
        return is_local(self.fs)

    def append_bytes(self, name: str, data: bytes) -> None:
        """Append to a file of the run's folder (local storage only: see `appends`)."""
        path = posixpath.join(self.root, name)

        def append() -> None:
            with open(path, "ab") as f:
                f.write(data)

        self.retry.call(f"appending to {self.url(name)}", append)

    def read(self, name: str) -> bytes | None:
        """A file of the run's folder (not a checkpoint); None when it is missing."""
        return self._read(posixpath.join(self.root, name))

    def _put(self, path: str, data: bytes, what: str) -> None:
        self.retry.call(what, self._put_local if is_local(self.fs) else self._put_object, path, data)

    def _put_object(self, path: str, data: bytes) -> None:
        """Write an object; on a filesystem the run was given that has folders (a pyarrow or fsspec
        wrapper of a disk) and lacks this one, make it first. Never on a URL's object store: s3fs's
        makedirs would create a missing bucket, where a missing bucket must fail."""
        try:
            self.fs.pipe_file(path, data)
        except FileNotFoundError:
            if not self._on_given_fs:
                raise
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe_file(path, data)

    def _put_local(self, path: str, data: bytes) -> None:
        """Write a local file whole or not at all: beside its name, then renamed over it. As in an
        object store, a write into a folder that a deletion removed meanwhile recreates it: the
        vanished folder is a transient error (EAGAIN), retried, never one that fails the run."""
        folder = posixpath.dirname(path)
        scratch = posixpath.join(folder, f".{posixpath.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            os.makedirs(folder, exist_ok=True)
            try:
                with open(scratch, "wb") as f:
                    f.write(data)
                os.replace(scratch, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(scratch)
                raise
        except FileNotFoundError as exc:
            raise OSError(errno.EAGAIN, f"{folder} was removed during the write") from exc

    # -- what this process commits or removes ------------------------------------------------------
    def begin_commit(self, attempt: Attempt) -> None:
        """Mark `attempt` as being committed by this process: `delete` and `sweep` leave its folder
        alone until `end_commit`. Raises `CommitRefused` if the folder is being removed."""
        with self._guard:
            if attempt in self._removing:
                raise CommitRefused(f"not committing {self.url(attempt.dirname)}: it is being removed")
            self._committing[attempt] += 1

    def end_commit(self, attempt: Attempt) -> None:
        """The commit of `attempt` that `begin_commit` marked is over (done or not)."""
        with self._guard:
            self._committing[attempt] -= 1
            if self._committing[attempt] <= 0:
                del self._committing[attempt]
            self._guard.notify_all()

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
        with self._guard:
            return self._guard.wait_for(lambda: not self._committing, timeout=timeout_s)

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
        with self._guard:
            if self._committing.get(attempt) or attempt in self._removing:
                logger.info("not removing %s: this process is committing or removing it", self.url(attempt.dirname))
                return False
            self._removing.add(attempt)
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
            with self._guard:
                self._removing.discard(attempt)

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

    def _remove(self, path: str) -> None:
        """Remove one object; one already gone (removed by another deletion, or a writer's scratch
        file renamed meanwhile) is what was asked for, not an error."""
        try:
            self.retry.call(f"deleting {path}", self.fs.rm, path)
        except StorageError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise

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


__all__ = ["RunStorage", "Attempt", "CommittedCheckpoint", "CommitRefused", "CorruptCheckpointError",
           "checkpoint_dirname", "LEGACY_GENERATION"]
