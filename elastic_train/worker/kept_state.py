"""The state a run keeps live for recovery when its loop reports no checkpoint:
`prepare_model(model, live_state=True)`.

Why: in data-parallel training every rank holds the whole current model and optimizer. With them
registered, each `report()` holds their state dicts by reference (live_part.py: no copy, no
serialization), so that after a peer is lost the run goes on from the last report with no step
redone and no checkpoint in the loop. The loop is re-entered in a new generation: its new model is
loaded from the held state in `prepare_model`, and each optimizer that steps the model's parameters
is found at its first step (a global `Optimizer` step pre-hook, so loops need no wrapper) and loaded
then, before the step runs. A newcomer gets the same state from a survivor.
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
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending: list[dict[str, Any]] = []  # restored optimizer states, loaded at each one's first step
        if restored is not None:
            if not _aliases(model, restored["model"]):  # a model object the loop kept across generations holds it already
                model.load_state_dict(restored["model"])
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
        return {"model": self._model.state_dict(), "optimizers": optimizers}

    def close(self) -> None:
        """The generation is over: its loop's optimizers are no longer watched."""
        self._hook.remove()


def _aliases(model: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Is `state` the model's own tensors? Then loading it would only write them onto themselves, and
    a state that a survivor holds for its peers must not be written."""
    own = model.state_dict()
    return own.keys() == state.keys() and all(own[k].data_ptr() == v.data_ptr() for k, v in state.items())
