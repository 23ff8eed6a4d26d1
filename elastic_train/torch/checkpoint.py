"""Ray Train's `TorchCheckpoint`: a checkpoint holding one model or its state dict (`model.pt`), with a
preprocessor in its metadata. Ray deprecates it for `Checkpoint`, and so do we, with the same warning;
it is here so that code written for it runs unchanged."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from typing import Any

import ray.cloudpickle
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from elastic_train.checkpoint.checkpoint import Checkpoint

PREPROCESSOR_KEY = "preprocessor_pkl"  # Ray's metadata key for it


class TorchCheckpoint(Checkpoint):
    """A `Checkpoint` with a Torch model (deprecated, as in Ray Train: report a `Checkpoint` of your
    own files, or `Checkpoint.from_dict({"model": model.state_dict()})`)."""

    MODEL_FILENAME = "model.pt"

    def __init__(self, *args: Any, **kwargs: Any):
        warnings.warn("`TorchCheckpoint` is deprecated and will be removed in a future release, as in Ray Train. "
                      "Use `elastic_train.Checkpoint` directly instead.", DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], *, preprocessor: Any = None) -> "TorchCheckpoint":
        """A checkpoint of `state_dict` (DDP's `module.` prefix removed, as Ray does), loaded with
        `get_model(model)`."""
        stripped = copy.copy(state_dict)
        if hasattr(state_dict, "_metadata"):
            stripped._metadata = copy.copy(state_dict._metadata)
        consume_prefix_in_state_dict_if_present(stripped, "module.")
        return cls._of(stripped, preprocessor)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, preprocessor: Any = None) -> "TorchCheckpoint":
        """A checkpoint of the whole pickled `model` (Ray deprecates this too: loading it runs code from
        the checkpoint; prefer `from_state_dict`)."""
        warnings.warn("`TorchCheckpoint.from_model()` is deprecated, as in Ray Train: it pickles the whole "
                      "module, and loading it runs code. Use `TorchCheckpoint.from_state_dict()`.",
                      DeprecationWarning, stacklevel=2)
        return cls._of(model, preprocessor)

    @classmethod
    def _of(cls, model_or_state_dict: Any, preprocessor: Any) -> "TorchCheckpoint":
        folder = tempfile.mkdtemp(prefix="elastic_train_torch_checkpoint_")
        torch.save(model_or_state_dict, os.path.join(folder, cls.MODEL_FILENAME))
        checkpoint = cls.from_directory(folder)
        if preprocessor is not None:
            checkpoint.set_preprocessor(preprocessor)
        return checkpoint

    def get_model(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """The stored model; a stored state dict is loaded into `model`. The checkpoint must come from a
        trusted source: a whole model is unpickled (as in Ray)."""
        with self.as_directory() as folder:
            path = os.path.join(folder, self.MODEL_FILENAME)
            if not os.path.exists(path):
                raise RuntimeError("`model.pt` not found within this checkpoint. Make sure you created this "
                                   "`TorchCheckpoint` from one of its public constructors (`from_state_dict` or "
                                   "`from_model`).")
            stored = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(stored, torch.nn.Module):
            if model is not None:
                warnings.warn("TorchCheckpoint already contains all information needed. Discarding provided "
                              "`model` argument.")
            return stored
        if not isinstance(stored, dict):
            raise ValueError(f"Saved model is of type {type(stored)}. The model saved in the checkpoint is expected "
                             "to be of type `torch.nn.Module`, or a model state dict of type dict.")
        if model is None:
            raise ValueError("Attempting to load torch model from a state_dict, but no `model_definition` was "
                             "provided.")
        model.load_state_dict(stored)
        return model

    def get_preprocessor(self) -> Any:
        """The preprocessor stored with the checkpoint, or None (unpickled: a trusted source only)."""
        stored = self.get_metadata().get(PREPROCESSOR_KEY)
        return None if stored is None else ray.cloudpickle.loads(bytes.fromhex(stored))

    def set_preprocessor(self, preprocessor: Any) -> None:
        """Store `preprocessor` in the checkpoint's metadata, as Ray does."""
        self.update_metadata({PREPROCESSOR_KEY: ray.cloudpickle.dumps(preprocessor).hex()})
