"""Where a run keeps its checkpoints: one folder per attempt, named by index and generation.

Layout: `<storage_path>/<name>/checkpoint_<index>_g<generation>/<files, as the user named them>`
plus the manifest (`manifest.py`), written last. A folder holds one generation's attempt at a
checkpoint (`Attempt`): after a failure the next generation reports the same indices again, while a
worker of the older one (fenced, or its store queue still busy) may still be writing; with a folder
per attempt, such a stale writer can never touch files of a checkpoint another generation commits.

A report may name its folder instead (`report(checkpoint_dir_name=...)`, as in Ray Train, or a
checkpoint the loop wrote there itself with `NO_UPLOAD`). Such a folder is known by its manifest;
one without a manifest is never removed (it may be the user's, half written), and a name used again
is written again: the newest commit under a name is the one it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from elastic_train.checkpoint.manifest import Manifest
from elastic_train.errors import CheckpointError

_FOLDER = re.compile(r"checkpoint_(\d+)(?:_g(\d+))?$")
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
    """An attempt whose manifest is written: where it is, and what the manifest says."""

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


def checkpoint_dirname(index: int, generation: int) -> str:
    return Attempt(index, generation).dirname


def check_named_folder(name: str, index: int, generation: int) -> None:
    """A folder a report names must not pass for one of ours (`checkpoint_<index>[_g<generation>]`):
    it would be read back as another attempt, and swept or retained as such."""
    if _FOLDER.match(name) and name != checkpoint_dirname(index, generation):
        raise CheckpointError(
            f"checkpoint folder name {name!r}: names like checkpoint_<digits>[_g<digits>] are elastic_train's own "
            "folders; pick another, e.g. f'epoch_{epoch}'.")
