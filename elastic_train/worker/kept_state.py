"""The state a run keeps live for recovery when its loop reports no checkpoint:
`prepare_model(model, live_state=True)`.

Why: in data-parallel training every rank holds the whole current model and optimizer. With them
registered, each `report()` holds their state dicts by reference (live_part.py: no copy, no
serialization), so that after a peer is lost the run goes on from the last report with no step
redone and no checkpoint in the loop. The loop is re-entered in a new generation: its new model is
loaded from the held state in `prepare_model`, and each optimizer that steps the model's parameters
is found at its first step (a global `Optimizer` step pre-hook, so loops need no wrapper) and loaded
then, before the step runs. A newcomer gets the same state from a survivor.

Parameters and optimizer state change only in `optimizer.step()`, after the step's collectives, so a
peer lost before then leaves them as the last report held them (live_part.py checks their versions).
Buffers change in the forward, before those collectives: BatchNorm's running statistics (written
without a version bump), its batch counter, and DDP's broadcast of rank 0's buffers at every forward.
So each report holds a copy of the buffers (a model's buffers are small: BatchNorm's, a few floats per
channel), and a failure mid-step goes on from the last report with no step redone.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


class KeptState:
    """One model's state and that of the optimizers that step its parameters, for this generation."""

    def __init__(self, model: torch.nn.Module, restored: dict[str, Any] | None,
                 before_step: Callable[[], None] = lambda: None):
        self._model = model
        self._before = before_step  # may raise: the step is then not taken (the session's commit)
        self._params = {id(p) for p in model.parameters()}
        self._buffers = [name for name, _ in model.named_buffers()]  # their state dict keys, copied at each report
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending: list[dict[str, Any]] = []  # restored optimizer states, loaded at each one's first step
        if restored is not None:
            _load(model, restored["model"])
            self._pending = list(restored["optimizers"])
        self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Register an optimizer of the model at its first step, with its restored state if any (in
        the order they first step: the same in every generation of the same loop)."""
        del args, kwargs
        if not any(o is optimizer for o in self._optimizers):
            if not any(id(p) in self._params for group in optimizer.param_groups for p in group["params"]):
                return  # another model's optimizer
            if len(self._optimizers) < len(self._pending):
                optimizer.load_state_dict(self._pending[len(self._optimizers)])
            self._optimizers.append(optimizer)
        self._before()

    def snapshot(self) -> dict[str, Any]:
        """The state now, by reference: a report's live part. An optimizer restored but not yet
        stepped counts with its restored state."""
        optimizers = [o.state_dict() for o in self._optimizers] + self._pending[len(self._optimizers):]
        model = self._model.state_dict()
        for name in self._buffers:
            if name in model:  # not a non-persistent buffer
                model[name] = model[name].clone()
        return {"model": model, "optimizers": optimizers}

    def close(self) -> None:
        """The generation is over: its loop's optimizers are no longer watched."""
        self._hook.remove()


def _load(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load `state` into `model`, but not onto the model's own tensors: a model object the loop kept
    across generations holds its parameters already, and a state that a survivor holds for its peers
    must not be written (each write moves its versions on: live_part.py)."""
    own = model.state_dict()
    fresh = {k: v for k, v in state.items() if k not in own or own[k].data_ptr() != v.data_ptr()}
    if len(fresh) == len(state):
        model.load_state_dict(state)
    else:
        model.load_state_dict(fresh, strict=False)
