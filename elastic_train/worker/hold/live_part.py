"""A dict checkpoint held by reference: the live state, serialized only when it must leave the process.

Why: in data-parallel training every rank already holds the current model and optimizer in its own
memory. `report(metrics, Checkpoint.from_dict({"model": model.state_dict(), ...}))` hands the
runtime the live tensors themselves (`state_dict()` returns them, not copies). Holding them costs
nothing; a `torch.save` every step costs milliseconds. So a dict checkpoint is kept as it is, and
serialized (`files()`) only when its bytes are needed: to store it, or to serve it to another worker
once the generation ended.

The catch is that the tensors go on changing: the next `optimizer.step()` writes into the very
tensors held. Every tensor's version counter (`Tensor._version`, bumped by each in-place write) is
noted when the part is made; the part is `clean()` only while none moved. A part that is no longer
clean holds some newer state under an older report's index: it is never served, and the run resumes
from an older checkpoint instead (see `HeldParts.freeze`).

A state kept live (worker/hold/kept_state.py) is not even made into a dict at its report: the report notes its
tensors' versions, and the dict is built when a recovery first reads it, from those very tensors
(building `state_dict()`s at every report was a third of a report's cost).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import torch

from elastic_train.checkpoint.checkpoint import DICT_FILE, METADATA_FILE, Checkpoint, dict_to_bytes, is_state_file


def tensors_in(value: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (a list, not a generator: walked at every
    report, where a generator per level costs twice the time)."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (dict, list, tuple)):
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (dict, list, tuple)):
                tensors_in(item, found)
    return found


class LivePart:
    """One rank's dict checkpoint, by reference, with the versions its tensors had when reported."""

    def __init__(self, data: dict[str, Any] | Callable[[], dict[str, Any]], file: str = DICT_FILE,
                 metadata: dict[str, Any] | None = None, tensors: list[torch.Tensor] | None = None,
                 private: bool = False):
        """`data`: the dict reported; or a function that builds it when first read, out of `tensors`
        (and tensors that share their storage), whose versions are noted now. `private`: `data` is a
        copy no one writes (a sharded model's share: worker/hold/sharded_state.py): kept beside newer parts, and
        serialized in the background to be replicated."""
        self.private = private
        self._data, self._build = (data, None) if isinstance(data, dict) else (None, data)
        self._file = file  # DICT_FILE; a kept state's file for the state a run keeps live with no checkpoint (worker/hold/kept_state.py)
        self._metadata = metadata
        self._versions = [(t, t._version) for t in (tensors_in(data) if tensors is None else tensors)]
        self._foreign = False  # built with a tensor not noted at the report (or noted, but written since)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> LivePart:
        """A `Checkpoint.from_dict` the loop reported."""
        return cls(checkpoint.to_dict(), metadata=checkpoint.get_metadata() or None)

    @property
    def data(self) -> dict[str, Any]:
        """The dict, built now if it was not at the report; check `clean()` after reading it."""
        with self._lock:
            if self._data is None:
                data = self._build()
                noted = {t.data_ptr(): version for t, version in self._versions}
                self._foreign = any(noted.get(t.data_ptr(), -1) != t._version for t in tensors_in(data))
                self._data = data
            return self._data

    @property
    def names(self) -> list[str]:
        """The file names `files()` gives, known without serializing."""
        return sorted([self._file] + ([METADATA_FILE] if self._metadata is not None else []))

    @property
    def state_only(self) -> bool:
        """The state kept for recovery alone (never stored), not a checkpoint the loop reported."""
        return is_state_file(self._file)

    def clean(self) -> bool:
        """Do the tensors still hold the state that was reported (none written in place since)?"""
        return not self._foreign and all(t._version == version for t, version in self._versions)

    def files(self) -> dict[str, bytes] | None:
        """The part's files, serialized now; None if a tensor was written to since the report (before
        or while it was serialized: then the bytes could mix two states)."""
        if not self.clean():
            return None
        files = {self._file: dict_to_bytes(self.data)}
        if self._metadata is not None:
            files[METADATA_FILE] = json.dumps(self._metadata).encode()
        return files if self.clean() else None
