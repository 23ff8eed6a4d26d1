"""Device placement and DDP wrapping for the current generation's process group."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker.group.ddp import ElasticDDP, DDPGroup
from elastic_train.worker.group.devices import get_device
from elastic_train.worker.group.reduction import StepReduction
from elastic_train.worker.group.world import world_group
from elastic_train.worker.hold.sharded_state import is_sharded
from elastic_train.worker.loop.current import current_session, get_session

T = TypeVar("T")


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
    live_state: bool = False,
) -> torch.nn.Module:
    """Move `model` to this worker's device and wrap it in DDP (or shard it with FSDP2: torch/fsdp.py)
    when the world can have several ranks.

    Call it on every generation's entry into the loop (the loop does): the DDP wrapper is bound to
    the process group of the generation it was made in. Ray Train returns the bare module at world
    size 1; so does this in a run of one worker. In an elastic run the world can shrink to 1 under a
    running loop, so the model is wrapped at every size: `model.module` works in every generation.

    Ours, on gloo: a peer lost during the step's gradient reduction does not unwind a loop that
    draws its data from `prepare_data_loader`. The survivors complete the step among themselves and
    the loop goes on where it was (worker/group/reduction.py); `get_context()` then answers the new rank and
    world size, so read them where they are used (as Ray Train's guides do), not once before the loop.

    `live_state=True` (ours): the run keeps the model's state, and that of the optimizers stepping
    its parameters, live in memory, so a loop that reports no checkpoint loses no step to a lost peer:
    each `report()` holds them by reference, and after a recovery the model is loaded here (each
    optimizer at its first step) from the last report's state. The loop goes on from its position:
    `for epoch in range(loader.epoch, epochs)` over a prepared loader, or from
    `get_context().get_resume_index()`. Put the step's collectives before `optimizer.step()`.
    """
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ValueError(f"prepare_model(parallel_strategy={parallel_strategy!r}): use 'ddp', 'fsdp' or None.")
    device = get_device()
    if move_to_device:
        model = model.to(device)
    wraps = parallel_strategy is not None and dist.is_initialized() and _max_world_size() > 1
    kwargs = dict(parallel_strategy_kwargs or {})
    session = current_session()
    if parallel_strategy == "fsdp":  # sharded before its state is kept: the kept state is the shards
        if wraps:
            from elastic_train.torch.fsdp import shard  # torch's FSDP, imported by the loops that use it

            model = shard(model, kwargs, device)
            if session is not None:
                session.bound_to_world()  # each rank holds its share of this world
        if live_state:
            get_session("prepare_model").keep_state(model)
        return model
    if live_state:
        get_session("prepare_model").keep_state(model)
    if not wraps or is_sharded(model):  # sharded by the loop (fully_shard): DDP would replicate it again
        return model
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index])
    if session is not None and "process_group" in kwargs:
        session.bound_to_world()
    if session is None or not session.recovers_in_place or world_group() is None:
        return DistributedDataParallel(model, **kwargs)
    # A peer lost under the loop: DDP's collectives and the step's reduction complete on the survivors.
    wrapped = ElasticDDP(model, process_group=DDPGroup(), **kwargs)
    StepReduction(session).register(wrapped)
    return wrapped


def keep_state(obj: T) -> T:
    """Ours: keep `obj`'s state with the state `prepare_model(model, live_state=True)` keeps, and
    return `obj`. For what else a recovery from that state needs: an LR scheduler above all (a fresh
    one in the re-entered loop would count its steps from 0), an AMP `GradScaler`, any object with
    `state_dict()` and `load_state_dict()`. Each report copies its `state_dict()`; after a recovery it
    is loaded into the object handed over in the same order, at once:

        model = prepare_model(model, live_state=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = keep_state(torch.optim.lr_scheduler.StepLR(optimizer, step_size=100))

    The optimizer itself needs no call: it is kept at its first step."""
    get_session("torch.keep_state").keep_object(obj)
    return obj


def _max_world_size() -> int:
    """The largest world the run can have: the generation's when called outside a run's loop."""
    session = current_session()
    if session is None:
        return dist.get_world_size()
    return max(session.context.assignment.max_world_size, dist.get_world_size())
