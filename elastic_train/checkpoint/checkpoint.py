"""`Checkpoint`: a directory of files (local or in fsspec storage) or an in-memory dict.

A checkpoint opened from a run's storage carries its manifest: reading it reads only the files the
manifest lists, and checks each against its size and checksum.

A dict checkpoint is stored as one file, `dict_checkpoint.pt`, written with `torch.save` and read
back with `torch.load(weights_only=True)`, so nothing from a checkpoint is ever unpickled as code.
Treating both kinds as files gives one merge rule for the parts that ranks report: files keep their
names, and ranks that write the same name write the same (replicated) content.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterator

import fsspec

from elastic_train.checkpoint.filesystems import as_fsspec
from elastic_train.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest
from elastic_train.errors import CheckpointError

DICT_FILE = "dict_checkpoint.pt"
METADATA_FILE = ".metadata.json"  # Checkpoint.set_metadata's file, as in Ray Train
STATE_FILE = "live_state.pt"  # the state `prepare_model(model, live_state=True)` keeps: for recovery only, never stored
DICT_PART_NAMES = {DICT_FILE, METADATA_FILE, STATE_FILE}  # a dict part's files: one rank's part is all of it
_SHARE_FILE = re.compile(r"live_state\.(\d+)\.pt")  # a sharded model's kept state: each rank's share (worker/hold/sharded_state.py)


def share_file(rank: int) -> str:
    """The file of rank `rank`'s share of a sharded model's kept state."""
    return f"live_state.{rank}.pt"


def share_rank(name: str) -> int | None:
    """The rank whose share file `name` is; None if it is none."""
    found = _SHARE_FILE.fullmatch(name)
    return int(found.group(1)) if found else None


def is_state_file(name: str) -> bool:
    """A kept state's file (whole, or a rank's share): for recovery only, never stored."""
    return name == STATE_FILE or share_rank(name) is not None


def needs_replica(names: list[str], every_rank_holds_one: bool) -> bool:
    """Should a rank's part be copied to a peer? Not a dict checkpoint that every rank reported: each
    rank then holds all of it already (a copy would double every rank's memory for nothing)."""
    return not (every_rank_holds_one and set(names) <= DICT_PART_NAMES)


def dict_to_bytes(data: dict[str, Any]) -> bytes:
    import torch  # here, not at the top: the supervisor and the driver open checkpoints without torch's 1.3 s

    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def dict_from_bytes(raw: bytes) -> dict[str, Any]:
    import torch  # see dict_to_bytes

    try:
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - re-raised with the fix in the message
        raise CheckpointError(
            f"Could not load {DICT_FILE} with torch.load(weights_only=True): {exc}. Dict checkpoints may hold "
            "tensors, numbers, strings and containers of them; save other objects in a directory checkpoint."
        ) from exc


class Checkpoint:
    """A reported or restored checkpoint (Ray Train's API)."""

    def __init__(
        self,
        path: str | os.PathLike,
        filesystem: Any = None,
        manifest: Manifest | None = None,
    ):
        self.path = str(path)
        self._filesystem = as_fsspec(filesystem) if filesystem is not None else None  # pyarrow's too, as in Ray
        self.manifest = manifest
        self._dict: dict[str, Any] | None = None
        self._metadata: dict[str, Any] | None = None  # a dict checkpoint's metadata

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """Where `path` is; the local disk unless given. Resolved when first used: a dict checkpoint
        reported every step never needs it (resolving it costs ~0.15 ms)."""
        if self._filesystem is None:
            self._filesystem = fsspec.filesystem("file")
        return self._filesystem

    @property
    def on_local_disk(self) -> bool:
        """Is `path` on this machine's disk? Told without resolving the filesystem when none was given."""
        return self._filesystem is None or is_local(self._filesystem)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Checkpoint":
        """A checkpoint of the files under a local directory; a stored checkpoint's folder (a run's
        `checkpoint_*`, as Ray users open one) is read through its manifest, each file verified."""
        if not os.path.isdir(path):
            raise CheckpointError(f"Checkpoint.from_directory({str(path)!r}): no such directory.")
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.exists(manifest_path):
            return cls(os.path.abspath(path))
        try:
            with open(manifest_path) as f:
                return cls(os.path.abspath(path), manifest=Manifest.from_json(f.read()))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(
                f"Checkpoint.from_directory({str(path)!r}): {MANIFEST} is the name elastic_train gives its commit "
                f"record, and this one is not ({exc}); rename that file."
            ) from exc

    @classmethod
    def from_ray(cls, checkpoint: Any) -> "Checkpoint":
        """The checkpoint a `ray.train.Checkpoint` points at (its path on its pyarrow filesystem): a
        helper written for Ray (its test utilities, a library) may still make Ray's."""
        if type(checkpoint).__module__.split(".")[:2] != ["ray", "train"] or not hasattr(checkpoint, "filesystem"):
            raise TypeError(f"a checkpoint must be an elastic_train.Checkpoint, got {type(checkpoint).__name__}.")
        return cls(checkpoint.path, checkpoint.filesystem)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Checkpoint":
        """A checkpoint of an in-memory dict of tensors, numbers, strings and containers."""
        if not isinstance(data, dict):
            raise CheckpointError(f"Checkpoint.from_dict needs a dict, got {type(data).__name__}.")
        checkpoint = cls("")
        checkpoint._dict = data
        return checkpoint

    @property
    def in_memory(self) -> bool:
        """A dict checkpoint (`from_dict`), not a directory."""
        return self._dict is not None

    def get_metadata(self) -> dict[str, Any]:
        """The metadata stored with the checkpoint (`.metadata.json`, as in Ray Train); {} if none."""
        if self._dict is not None:
            return dict(self._metadata or {})
        if self.manifest is not None and METADATA_FILE not in self.manifest.files:
            return {}
        raw = self._read(METADATA_FILE)
        if self.manifest is not None and (problem := self.manifest.problem(METADATA_FILE, raw)) is not None:
            raise CorruptCheckpointError(f"checkpoint {self.path} is corrupt: {problem}")
        return {} if raw is None else json.loads(raw)

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Store `metadata` (JSON-serializable) with the checkpoint, replacing any; do it before the
        checkpoint is reported. A committed checkpoint cannot change: its manifest holds every file's
        checksum."""
        if self.manifest is not None:
            raise CheckpointError(
                f"Checkpoint at {self.path} is committed: its files, {METADATA_FILE} included, are fixed by its "
                "manifest. Set metadata before report(), or report a new checkpoint with it.")
        raw = json.dumps(metadata).encode()
        if self._dict is not None:
            self._metadata = json.loads(raw)
            return
        with self.filesystem.open(f"{self.path.rstrip('/')}/{METADATA_FILE}", "wb") as f:
            f.write(raw)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Merge `metadata` into the checkpoint's stored metadata."""
        self.set_metadata({**self.get_metadata(), **metadata})

    def files(self) -> dict[str, bytes]:
        """Every file of the checkpoint by relative path: the snapshot that a report keeps."""
        if self._dict is not None:
            files = {DICT_FILE: dict_to_bytes(self._dict)}
            if self._metadata is not None:
                files[METADATA_FILE] = json.dumps(self._metadata).encode()
            return files
        if self.manifest is None and self._filesystem is None:  # the local disk, read directly: fsspec's walk cost ~0.2 ms
            return _read_tree(self.path)
        if self.manifest is None:
            root = self._root()
            return {full[len(root) + 1 :]: self.filesystem.cat_file(full) for full in self.filesystem.find(root)}
        return self.manifest.verified_files(self._read, self.path)

    def _root(self) -> str:
        return self.filesystem._strip_protocol(self.path).rstrip("/")

    def _read(self, name: str) -> bytes | None:
        """File `name` of a directory checkpoint, unchecked; None when it is missing."""
        try:
            return self.filesystem.cat_file(f"{self._root()}/{name}")
        except FileNotFoundError:
            return None

    def to_dict(self) -> dict[str, Any]:
        """The dict this checkpoint was made from."""
        if self._dict is not None:
            return self._dict
        files = self.files()
        if DICT_FILE not in files:
            raise CheckpointError(
                f"Checkpoint at {self.path} has no {DICT_FILE}: it is a directory checkpoint; "
                "use as_directory() to read its files."
            )
        return dict_from_bytes(files[DICT_FILE])

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Write the checkpoint's files into the local directory `path` (created if needed; a new
        temporary one when None, which the caller removes) and return it (Ray Train's API). A
        committed checkpoint's files are checked against its manifest first."""
        target = tempfile.mkdtemp(prefix="elastic_train_ckpt_") if path is None else os.path.expanduser(str(path))
        os.makedirs(target, exist_ok=True)
        write_files(target, self.files())
        return os.path.normpath(target)

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory holding the checkpoint's files (a temporary copy if it is remote)."""
        if self._dict is None and self.manifest is None and is_local(self.filesystem):
            yield self.path
            return
        tmp = tempfile.mkdtemp(prefix="elastic_train_ckpt_")
        try:
            write_files(tmp, self.files())
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def __repr__(self) -> str:
        """As Ray's: `Checkpoint(filesystem=local, path=/tmp/ckpt)`, the filesystem by its protocol."""
        if self._dict is not None:
            return "Checkpoint(dict)"
        shown = "local" if is_local(self.filesystem) else protocol_of(self.filesystem)
        return f"Checkpoint(filesystem={shown}, path={self.path})"


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    """The filesystem's protocol (its first, for one that has several names)."""
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _read_tree(root: str) -> dict[str, bytes]:
    """Every file under local folder `root` by relative path ('/'-separated), as fsspec's `find` lists
    them (linked folders followed)."""
    files = {}
    for folder, _, names in os.walk(root, followlinks=True):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return files


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return protocol_of(fs) in ("file", "local")


def write_files(directory: str, files: dict[str, bytes]) -> None:
    """Write `files` (relative path -> bytes) under a local directory."""
    for rel, data in files.items():
        target = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)


def checkpoint_from_files(files: dict[str, bytes], scratch: str) -> Checkpoint:
    """A checkpoint for files held in memory: a dict if that is all it holds, else a directory
    written under `scratch` (which the caller removes when it is done with the checkpoint)."""
    if set(files) - {METADATA_FILE} == {DICT_FILE}:
        checkpoint = Checkpoint.from_dict(dict_from_bytes(files[DICT_FILE]))
        if METADATA_FILE in files:
            checkpoint._metadata = json.loads(files[METADATA_FILE])
        return checkpoint
    directory = tempfile.mkdtemp(prefix="restored_", dir=scratch)
    write_files(directory, files)
    return Checkpoint.from_directory(directory)
