"""`prepare_model(model, parallel_strategy="fsdp")`: the model sharded with FSDP2 over the generation's
world.

Why FSDP2 (`fully_shard`) where Ray Train wraps FSDP1: FSDP1 refuses CPU devices, and its flat
parameters tie a checkpoint to the world size it was made at; FSDP2 shards each parameter on its
first dimension as a DTensor over a device mesh, on gloo and NCCL alike, and DCP re-shards it to any
world (torch/state.py), which is what an elastic run needs. Ray's keywords are FSDP1's: those whose
meaning carries over are translated (`fsdp_arguments`), the others refused with what to use instead.
Each generation builds its own mesh: the loop that re-enters calls `prepare_model` again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy,
                                    ShardingStrategy, fully_shard)
from torch.distributed.fsdp.wrap import _Policy

FSDP2_KEYWORDS = ("reshard_after_forward", "mp_policy", "offload_policy", "shard_placement_fn", "ignored_params")
# FSDP1 keywords with no effect under FSDP2: it prefetches, limits all-gathers and keeps the original
# parameters by itself, and the device is the worker's.
NO_EFFECT = ("device_id", "use_orig_params", "forward_prefetch", "backward_prefetch", "limit_all_gathers")
REFUSED = {
    "process_group": "the run builds each generation's process group and mesh",
    "device_mesh": "the run builds each generation's process group and mesh",
    "mesh": "the run builds each generation's process group and mesh",
    "param_init_fn": "build the model's parameters before prepare_model (on the meta device, then to_empty)",
    "ignored_states": "pass ignored_params (a set of parameters) or ignored_modules",
}


@dataclass
class FsdpPlan:
    """What `prepare_model` does with Ray's FSDP keywords: which submodules become their own shard
    units (besides the root), the keywords for each `fully_shard`, whether rank 0's values are
    broadcast first."""

    shard_kwargs: dict[str, Any] = field(default_factory=dict)
    units: Callable[[torch.nn.Module, tuple[torch.nn.Module, ...]], list[torch.nn.Module]] | None = None
    ignored_modules: tuple[torch.nn.Module, ...] = ()
    sync_module_states: bool = False


def fsdp_arguments(kwargs: dict[str, Any]) -> FsdpPlan:
    """Translate `parallel_strategy_kwargs` (FSDP1's, as Ray passes them, or FSDP2's own) into a plan;
    a keyword that cannot mean the same here is a ValueError naming what to use instead."""
    plan = FsdpPlan()
    for name, value in kwargs.items():
        if name in FSDP2_KEYWORDS:
            plan.shard_kwargs[name] = value
        elif name in NO_EFFECT:
            continue
        elif name in REFUSED:
            raise ValueError(f"prepare_model(parallel_strategy='fsdp'): {name} is not supported: {REFUSED[name]}.")
        elif name == "auto_wrap_policy":
            plan.units = None if value is None else _units(value)
        elif name == "sharding_strategy":
            plan.shard_kwargs["reshard_after_forward"] = _reshard_after_forward(value)
        elif name == "mixed_precision":
            if value is not None:
                plan.shard_kwargs["mp_policy"] = _mixed_precision(value)
        elif name == "cpu_offload":
            if isinstance(value, CPUOffload) and value.offload_params:
                plan.shard_kwargs["offload_policy"] = CPUOffloadPolicy()
        elif name == "ignored_modules":
            plan.ignored_modules = tuple(value or ())
        elif name == "sync_module_states":
            plan.sync_module_states = bool(value)
        else:
            known = sorted({*FSDP2_KEYWORDS, *NO_EFFECT, "auto_wrap_policy", "sharding_strategy", "mixed_precision",
                            "cpu_offload", "ignored_modules", "sync_module_states"})
            raise ValueError(f"prepare_model(parallel_strategy='fsdp'): unknown keyword {name!r}; known: {', '.join(known)}.")
    return plan


def _reshard_after_forward(strategy: ShardingStrategy | str | None) -> bool:
    strategy = ShardingStrategy[strategy] if isinstance(strategy, str) else strategy
    if strategy in (None, ShardingStrategy.FULL_SHARD):
        return True
    if strategy is ShardingStrategy.SHARD_GRAD_OP:
        return False
    fix = ("use parallel_strategy='ddp'" if strategy is ShardingStrategy.NO_SHARD
           else "shard over the whole world (FULL_SHARD); replicas across nodes are not built here")
    raise ValueError(f"prepare_model(parallel_strategy='fsdp'): sharding_strategy={strategy.name} is not supported: {fix}.")


def _mixed_precision(mp: MixedPrecision | MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    if isinstance(mp, MixedPrecisionPolicy):
        return mp
    if mp.buffer_dtype is not None or mp.keep_low_precision_grads:
        raise ValueError(
            "prepare_model(parallel_strategy='fsdp'): MixedPrecision(buffer_dtype=..., keep_low_precision_grads=...) "
            "has no FSDP2 counterpart: FSDP2 keeps buffers as the model has them and gradients in the parameters' "
            "dtype. Pass param_dtype and reduce_dtype alone, or an FSDP2 mp_policy=MixedPrecisionPolicy(...).")
    return MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)


def _units(policy: Any) -> Callable[[torch.nn.Module, tuple[torch.nn.Module, ...]], list[torch.nn.Module]]:
    """An FSDP1 auto-wrap policy as the submodules it would wrap, innermost first (FSDP2 shards
    children before parents), as FSDP1's recursion decides: a module is descended into only where
    the policy says so with `recurse=True`, and asked with `recurse=False` for the parameters its
    wrapped descendants leave it; ignored modules are skipped."""
    if not isinstance(policy, _Policy) and not callable(policy):
        raise ValueError(f"prepare_model(parallel_strategy='fsdp'): auto_wrap_policy={policy!r} is not a policy.")

    def chosen(root: torch.nn.Module, ignored: tuple[torch.nn.Module, ...]) -> list[torch.nn.Module]:
        skipped = {id(p) for m in ignored for p in m.parameters()}
        if isinstance(policy, _Policy):
            wrapped = policy._run_policy(root, set(ignored), {})
            return [m for m in reversed(list(root.modules())) if m in wrapped and m is not root]
        out: list[torch.nn.Module] = []

        def walk(module: torch.nn.Module, is_root: bool) -> int:
            """The parameters of `module` that end up in a unit."""
            numel = sum(p.numel() for p in module.parameters() if id(p) not in skipped)
            if not policy(module=module, recurse=True, nonwrapped_numel=numel):
                return 0
            inner = sum(walk(child, False) for child in module.children() if not any(child is m for m in ignored))
            if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - inner):
                out.append(module)
                return numel
            return inner

        walk(root, True)
        return out

    return chosen


def shard(model: torch.nn.Module, kwargs: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """`model` sharded with FSDP2 over a 1-D mesh of this generation's world (the default group)."""
    plan = fsdp_arguments(kwargs)
    if plan.sync_module_states:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shard_kwargs = dict(plan.shard_kwargs)
    if plan.ignored_modules:
        ignored = {p for m in plan.ignored_modules for p in m.parameters()}
        shard_kwargs["ignored_params"] = ignored | set(shard_kwargs.get("ignored_params") or ())
    for module in plan.units(model, plan.ignored_modules) if plan.units is not None else []:
        fully_shard(module, mesh=mesh, **shard_kwargs)
    fully_shard(model, mesh=mesh, **shard_kwargs)
    return model
