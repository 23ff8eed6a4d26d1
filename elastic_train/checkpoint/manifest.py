"""The commit record of a checkpoint: which files it holds (size and checksum each), and what it is.

Why: a checkpoint folder in an object store fills one object at a time, and a crash can stop it
anywhere. The manifest is written last, after every part is stored; a folder without one is torn
and never restored. Its sizes and checksums let a restore prove that each file is the one that was
written, so a truncated or overwritten shard is found before any training state is built from it.

The checksum is XXH3-128: made for this job (finding damage, not resisting an adversary), it runs at
~27 GB/s here where SHA-256 ran at ~1.9 GB/s and held a checkpoint's save to 0.34 of a raw copy
(benchmarks/RESULTS.md). Files recorded with a SHA-256, by earlier versions, are checked with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping

import xxhash

from elastic_train.errors import CheckpointError

MANIFEST = "elastic_train_manifest.json"
FORMAT_VERSION = 1


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's file is missing or differs from what was written: from its manifest (a committed
    checkpoint), or from the facts it was reported with (a part held in memory)."""


CHECKSUM = "xxh3_128"  # the key of the checksum in a file's facts, and the algorithm that makes it
# Every checksum a file's facts may carry, by key: what a file is checked with is the one it was made with.
_DIGESTS: dict[str, Callable[[], Any]] = {CHECKSUM: xxhash.xxh3_128, "sha256": hashlib.sha256}


def new_digest() -> Any:
    """A digest to feed a file in pieces (`update`), for facts made from a stream."""
    return _DIGESTS[CHECKSUM]()


def facts_of(data: bytes) -> dict[str, Any]:
    """A file's facts: its size and checksum."""
    return {"size": len(data), CHECKSUM: _DIGESTS[CHECKSUM](data).hexdigest()}


def file_facts(files: Mapping[str, bytes]) -> dict[str, dict[str, Any]]:
    """`{name: {"size", "xxh3_128"}}` for files held in memory."""
    return {name: facts_of(data) for name, data in files.items()}


HASHING_NICE = 19  # the hashing thread's nice value: it yields the CPU to the loop's threads
HASHED_AT_ONCE_BYTES = 1 << 20  # files up to this size in all are hashed at once (~40 us): less than a thread's hand-off


def _yield_to_the_loop() -> None:
    """Lower the hashing thread's priority. On Linux a nice value is a thread's own (`setpriority`
    with `who=0` is the calling thread); elsewhere it would be the whole process's, so it is left."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, 0, HASHING_NICE)


_HASHING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-facts", initializer=_yield_to_the_loop)


def facts_soon(files: Mapping[str, bytes]) -> Future[dict[str, dict[str, Any]]]:
    """The facts of files just snapshotted, made on a background thread of low priority, so that the
    report does not wait for the hash (its cost: benchmarks/RESULTS.md); small ones at once. The bytes
    are immutable: the facts are those of the files as reported."""
    if sum(len(data) for data in files.values()) > HASHED_AT_ONCE_BYTES:
        return _HASHING.submit(file_facts, files)
    made: Future[dict[str, dict[str, Any]]] = Future()
    made.set_result(file_facts(files))
    return made


def facts_made(files: Mapping[str, bytes], facts: Mapping[str, dict[str, Any]] | Future[dict[str, dict[str, Any]]] | None
               ) -> dict[str, dict[str, Any]] | None:
    """The facts of `files` that `facts` gives, waited for if on their way; made now if their making
    was cancelled (the memory evicted the part before its turn: the hashing thread never falls behind
    by more than what is held)."""
    if isinstance(facts, Future):
        try:
            return facts.result()
        except CancelledError:
            return file_facts(files)
    return dict(facts) if facts is not None else None


def checked_facts(files: Mapping[str, bytes], facts: Mapping[str, dict[str, Any]] | None,
                  where: str) -> dict[str, dict[str, Any]]:
    """The facts of `files`: those they were made with (`facts`), once the files are checked against
    them (a file that no longer matches raises: its copy was corrupted since), or made now."""
    if not facts:
        return file_facts(files)
    for name, data in files.items():
        problem = file_problem(name, data, facts[name], "its report") if name in facts else f"{name} was not reported"
        if problem is not None:
            raise CorruptCheckpointError(f"{where} is corrupt: {problem}")
    return {name: dict(facts[name]) for name in files}


def file_problem(name: str, data: bytes | None, expected: Mapping[str, Any], source: str) -> str | None:
    """Why `data`, read as file `name`, is not the file whose facts `source` gives as `expected`; None
    when it is."""
    if data is None:
        return f"{name} is missing"
    if len(data) != expected["size"]:
        return f"{name} has {len(data)} bytes, {source} says {expected['size']}"
    kind = next((k for k in _DIGESTS if k in expected), None)
    if kind is None:
        return f"{name} has no checksum in {source} (one of {', '.join(_DIGESTS)})"
    digest = _DIGESTS[kind]()
    digest.update(data)
    if digest.hexdigest() != expected[kind]:
        return f"{name} does not match its checksum ({kind}) in {source}"
    return None


@dataclass
class Manifest:
    """What a committed checkpoint holds. `step` is the report index the checkpoint was reported at."""

    step: int
    generation: int
    world_size: int
    files: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)
    loader_states: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        raw = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def problem(self, name: str, data: bytes | None) -> str | None:
        """Why `data`, read as file `name`, is not what was committed; None when it is."""
        return file_problem(name, data, self.files[name], "the manifest")

    def checked(self, read: Callable[[str], bytes | None]) -> Iterator[tuple[str, bytes | None, str | None]]:
        """Every listed file, read by name with `read` (None when missing), and its problem (None when whole)."""
        for name in sorted(self.files):
            data = read(name)
            yield name, data, self.problem(name, data)

    def verified_files(self, read: Callable[[str], bytes | None], where: str) -> dict[str, bytes]:
        """Every listed file, read with `read`; the first one that is not what was committed raises."""
        files = {}
        for name, data, problem in self.checked(read):
            if problem is not None:
                raise CorruptCheckpointError(f"checkpoint {where} is corrupt: {problem}")
            files[name] = data
        return files
