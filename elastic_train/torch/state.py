"""Save and load model + optimizer state as a sharded checkpoint that any world size can load.

Why `torch.distributed.checkpoint` (DCP): it is the field's standard format; its save planner
writes each replicated (DDP) tensor once and spreads those writes over the ranks, so N ranks write
about 1/N of the bytes each; its load planner reads whatever layout was saved into the layout of
the loading world. What we add is safety: stock DCP unpickles its `.metadata` file and non-tensor
values with `weights_only=False`, i.e. it runs code found in storage. Here the metadata is read
with an unpickler that accepts only DCP's own metadata classes, and non-tensor values load with
`torch.load(weights_only=True)`.

Each rank calls `save_state` on a local directory of its own and reports it with
`elastic_train.report(metrics, Checkpoint.from_directory(d))`: the ranks' files merge by name into
one checkpoint (`.metadata` from rank 0, `__<rank>_0.distcp` from each rank), and the runtime
persists it. `load_state` reads such a merged directory, in a process group of any size.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic_train.errors import CheckpointError

EXTRA_FILE = "train_state.json"

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata`, refusing any global that is not part of its format."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"refusing to load {module}.{name} from checkpoint metadata: only torch.distributed.checkpoint "
            "metadata classes are allowed (the file may not come from save_state, or may be tampered with)."
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values loaded by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """DCP's view of the model's (and optimizer's) state: what is saved, and what a load fills in."""
    model_state, optim_state = get_state_dict(model, optimizer or [])
    return {"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})}


def save_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write this rank's part of `model` (+ `optimizer`) state into `directory`.

    A collective: every rank of the process group calls it, each with a directory of its own.
    `extra` (JSON-serializable, e.g. the step) is written by rank 0 as `train_state.json`.
    """
    os.makedirs(directory, exist_ok=True)
    state = _state_dicts(model, optimizer)
    dcp.save(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    if extra is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        with open(os.path.join(directory, EXTRA_FILE), "w") as f:
            json.dump(extra, f)


def load_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any] | None:
    """Load a checkpoint written by `save_state` (at any world size) into `model` (+ `optimizer`).

    A collective when a process group exists. Returns the `extra` dict saved with it, if any.
    """
    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise CheckpointError(
            f"{directory} holds no torch.distributed.checkpoint metadata (.metadata): it was not written by "
            "save_state, or rank 0's part of the checkpoint is missing."
        )
    state = _state_dicts(model, optimizer)
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(directory)),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:
        raise CheckpointError(f"loading the state in {directory} failed: {exc}") from exc
    set_state_dict(model, optimizer or [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
    extra_path = pathlib.Path(directory, EXTRA_FILE)
    return json.loads(extra_path.read_text()) if extra_path.exists() else None


__all__ = ["save_state", "load_state", "SafeFileSystemReader", "SafeLoadPlanner"]
