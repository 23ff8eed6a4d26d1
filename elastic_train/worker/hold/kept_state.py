"""The state a run keeps live for recovery when its loop reports no checkpoint:
`prepare_model(model, live_state=True)`.

Why: in data-parallel training every rank holds the whole current model and optimizer. With them
registered, each `report()` holds their state dicts by reference (worker/hold/live_part.py: no copy, no
serialization), so that after a peer is lost the run goes on from the last report with no step
redone and no checkpoint in the loop. The loop is re-entered in a new generation: its new model is
loaded from the held state in `prepare_model`, and each optimizer that steps the model's parameters
is found at its first step (a global `Optimizer` step pre-hook, so loops need no wrapper) and loaded
then, before the step runs. A newcomer gets the same state from a survivor.

Parameters and optimizer state change only in `optimizer.step()`, after the step's collectives, so a
peer lost before then leaves them as the last report held them (worker/hold/live_part.py checks their versions).
Buffers change in the forward, before those collectives: BatchNorm's running statistics (written
without a version bump), its batch counter, and DDP's broadcast of rank 0's buffers at every forward.
So each report holds a copy of the buffers (a model's buffers are small: BatchNorm's, a few floats per
channel), and a failure mid-step goes on from the last report with no step redone.

The loop's other state that recovery needs, an LR scheduler above all (its step count decides the
learning rate), is kept alongside when the loop hands it over (`elastic_train.torch.keep_state`): its
`state_dict()` is copied at each report (it changes with no tensor version) and loaded back into
the object the re-entered loop hands over in the same place.

A sharded model (FSDP2) is the exception: each rank holds a share no other has, so each report copies
it to host memory (worker/hold/sharded_state.py), and a recovery re-shards the old ranks' shares to the new world.

A report builds no state dict: it notes the versions of the parameters and of the optimizers' state
tensors and copies the buffers and the optimizers' hyperparameters (a scheduler writes those with no
version); the state dicts are built when a recovery reads them (worker/hold/live_part.py), out of the same tensors.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_train.checkpoint.checkpoint import STATE_FILE, share_file
from elastic_train.worker.hold.live_part import LivePart, tensors_in
from elastic_train.worker.hold.sharded_state import is_sharded, local_copy


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class KeptState:
    """One model's state and that of the optimizers that step its parameters, for this generation."""

    def __init__(self, model: torch.nn.Module, restored: dict[str, Any] | None,
                 before_step: Callable[[], None] = lambda: None):
        self._model = model
        self._sharded = is_sharded(model)  # FSDP2: this rank's share of the state, copied at each report
        self._before = before_step  # may raise: the step is then not taken (the session's commit)
        self._params = {id(p) for p in model.parameters()}
        persistent = set(model.state_dict())
        # (module, key) of each parameter and persistent buffer, looked up at each report: `model.to()`
        # and the like put new tensors in them. Buffers under their state dict keys, copied at each report.
        self._param_slots = [(module, key) for _, module in model.named_modules() for key in module._parameters]
        buffers = [(f"{prefix}.{key}" if prefix else key, module, key) for prefix, module in model.named_modules()
                   for key in module._buffers]
        self._buffer_slots = [slot for slot in buffers if slot[0] in persistent]
        self._optimizers: list[torch.optim.Optimizer] = []
        self._pending: list[dict[str, Any]] = []  # restored optimizer states, loaded at each one's first step
        self._objects: list[Stateful] = []  # `keep()`: an LR scheduler, ...
        self._restored_objects: list[dict[str, Any]] = []
        if restored is not None:
            _load(model, restored["model"], self._sharded)
            self._pending = list(restored["optimizers"])
            self._restored_objects = list(restored["objects"])
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

    @property
    def sharded(self) -> bool:
        """Is the model sharded (each rank holds its share of the world it was built at)?"""
        return self._sharded

    def keep(self, obj: Stateful) -> None:
        """Keep `obj`'s state too; loaded now from the state restored, if this generation has one (the
        objects are matched by the order the loop hands them over)."""
        if len(self._objects) < len(self._restored_objects):
            obj.load_state_dict(copy.deepcopy(self._restored_objects[len(self._objects)]))
        self._objects.append(obj)

    def snapshot(self) -> LivePart:
        """The state now, by reference: a report's live part, its state dicts built when first read.
        An optimizer restored but not yet stepped counts with its restored state."""
        buffers = {name: module._buffers[key].clone() for name, module, key in self._buffer_slots
                   if module._buffers[key] is not None}
        optimizers = list(self._optimizers)
        groups = [[{k: v for k, v in group.items() if k != "params"} for group in o.param_groups] for o in optimizers]
        pending = self._pending[len(optimizers):]
        objects = [copy.deepcopy(o.state_dict()) for o in self._objects] + self._restored_objects[len(self._objects):]
        tensors = [t for module, key in self._param_slots if (t := module._parameters[key]) is not None]
        tensors += [t for o in optimizers for state in o.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor)]
        tensors += list(buffers.values()) + (tensors_in([pending, objects]) if pending or objects else [])

        def build() -> dict[str, Any]:
            model = self._model.state_dict()
            model.update(buffers)
            built = [o.state_dict() for o in optimizers]
            for state, hyper in zip(built, groups):  # as they were at the report
                if len(hyper) == len(state["param_groups"]):
                    state["param_groups"] = [{**g, "params": h["params"]} for g, h in zip(hyper, state["param_groups"])]
            return {"model": model, "optimizers": built + pending, "objects": objects}

        if self._sharded:
            rank = dist.get_rank() if dist.is_initialized() else 0
            return LivePart(local_copy(build(), rank), file=share_file(rank), private=True)
        return LivePart(build, file=STATE_FILE, tensors=tensors)

    def close(self) -> None:
        """The generation is over: its loop's optimizers are no longer watched."""
        self._hook.remove()


def _load(model: torch.nn.Module, state: dict[str, Any], sharded: bool) -> None:
    """Load `state` into `model`, but not onto the model's own tensors: a model object the loop kept
    across generations holds its parameters already, and a state that a survivor holds for its peers
    must not be written (each write moves its versions on: worker/hold/live_part.py). A sharded model's state is
    made for it afresh (worker/hold/sharded_state.py `reshard`)."""
    if sharded:
        model.load_state_dict(state)
        return
    own = model.state_dict()
    fresh = {k: v for k, v in state.items() if k not in own or own[k].data_ptr() != v.data_ptr()}
    if len(fresh) == len(state):
        model.load_state_dict(state)
    else:
        model.load_state_dict(fresh, strict=False)
