"""The files of a run's folder in any fsspec store: each written whole, read, appended, removed.

Every file is an object of its own, written whole in one call (`pipe_file`: one PUT, or a multipart
upload that only appears once complete), so there is no rename step that an object store would turn
into a second copy. A local file is written beside its name and renamed over it, so that it too is
never seen half written. Every call is retried on transient errors (`retry.py`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import uuid
from typing import Any, Mapping, TypeVar

from elastic_train.checkpoint.checkpoint import is_local
from elastic_train.checkpoint.filesystems import open_filesystem
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.errors import ConfigError, StorageError

_SCRATCH = re.compile(r"\..+\.[0-9a-f]{12}\.tmp$")  # a local file being written (`_put_local`)

_Files = TypeVar("_Files", bound="RunFiles")


def is_scratch(name: str) -> bool:
    """Whether the file `name` is a local file still being written, not a file of its own."""
    return _SCRATCH.match(name) is not None


def _run_mark(run_id: str) -> str:
    return f".fit-{run_id}"


class RunFiles:
    """The folder of one run, file by file. Picklable: workers and the supervisor each build their own."""

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

    @classmethod
    def at(cls: type[_Files], run_path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
           **kwargs: Any) -> _Files:
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

    def check_writable(self) -> None:
        """Create the run's folder and write and remove a probe object: wrong credentials or a
        missing bucket fail here, before any actor starts."""
        probe = posixpath.join(self.root, f".probe-{uuid.uuid4().hex}")
        self.retry.call(f"creating {self.url()}", self.fs.makedirs, self.root, exist_ok=True)
        self.retry.call(f"writing to {self.url()}", self.fs.pipe_file, probe, b"")
        self.retry.call(f"deleting from {self.url()}", self.fs.rm, probe)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a file of the run's folder (not a checkpoint) whole."""
        self._put(posixpath.join(self.root, name), data, f"writing {self.url(name)}")

    def read(self, name: str) -> bytes | None:
        """A file of the run's folder (not a checkpoint); None when it is missing."""
        return self._read(posixpath.join(self.root, name))

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

    # -- one file, retried ------------------------------------------------------------------------
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

    def _read(self, path: str) -> bytes | None:
        try:
            return self.retry.call(f"reading {path}", self.fs.cat_file, path)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise

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
