"""What a survivor's process keeps from one generation to the next that describes the world it was
made in, and its reset as the next generation starts.

Why: a survivor keeps its process, and torch keeps per-process caches keyed by values that compare
equal across generations while meaning another rank. DTensor's sharding-propagation caches are keyed
by `DeviceMesh`, whose equality ignores which rank this process is: after a re-form that renumbers a
survivor (rank 2 -> 1), a cache hit hands FSDP2's new parameters the previous generation's mesh, and
with it the old rank's shard offsets. The loop then loads a DCP checkpoint into the wrong rows and
trains on, silently. TorchDynamo folds `dist.get_rank()` and `get_world_size()` into compiled code
as constants, without guards. docs/process_state.md lists everything kept and why the rest is safe.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

logger = logging.getLogger(__name__)

Place = tuple[int, int]  # (rank, world size) of one generation


def _dtensor_caches() -> None:
    """DTensor's sharding propagation (the Python cache of this thread and the C++ fast path's), its
    tensor-meta cache and its redistribution plans: their keys hold a DeviceMesh, equal across
    generations, their values the mesh object of the generation that filled them."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _device_mesh_stack() -> None:
    """The meshes entered with `with mesh:` (a loop unwound inside one leaves it behind)."""
    from torch.distributed.device_mesh import _mesh_resources

    _mesh_resources.mesh_stack.clear()


def _dcp_plan_caches() -> None:
    """DCP's cached save plans (`enable_plan_caching`): a global plan of the old world's ranks."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan, SavePlanner._cached_all_plans,
                  SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.clear()


def _dcp_async_process() -> None:
    """DCP's background saving process (`async_save` of type PROCESS): it keeps a process group with
    the previous generation's processes, some of which may be gone."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = executor._CHECKPOINT_PROCESS, None
    if process is not None and process._save_process.is_alive():
        process._save_process.kill()


def _compiled_code() -> None:
    """TorchDynamo's compiled code: it may hold the old rank and world size as constants."""
    import torch._dynamo

    torch._dynamo.reset()


# What is reset at every generation, each with the module that must have been imported for it to exist.
_EVERY_GENERATION: tuple[tuple[str, Callable[[], None]], ...] = (
    ("torch.distributed.tensor", _dtensor_caches),
    ("torch.distributed.device_mesh", _device_mesh_stack),
    ("torch.distributed.checkpoint", _dcp_plan_caches),
    ("torch.distributed.checkpoint._async_process_executor", _dcp_async_process),
)
# What is reset only when this process's rank or the world size changed (recompiling costs seconds).
_ON_NEW_PLACE: tuple[tuple[str, Callable[[], None]], ...] = (("torch._dynamo", _compiled_code),)


def reset_for_generation(previous: Place | None, place: Place) -> list[str]:
    """Reset what torch holds of the previous generation's world in this process, on the thread that
    runs the loop (some caches are per thread). `previous`: this process's place in the generation it
    ran last (None: its first). Returns what was reset. Call it once the new group is this process's
    default one and before the loop re-enters."""
    if previous is None:
        return []
    resets = _EVERY_GENERATION + (_ON_NEW_PLACE if previous != place else ())
    done = []
    for module, reset in resets:
        if module not in sys.modules:
            continue  # never imported: nothing of it to reset
        try:
            reset()
        except Exception as exc:  # noqa: BLE001 - another torch's layout, say: told, never fatal (it may go stale)
            logger.warning("could not reset %s (%s) for the new generation: %r; a loop relying on it may "
                           "see the previous generation's world", reset.__name__.lstrip("_"), module, exc)
            continue
        done.append(reset.__name__.lstrip("_"))
    logger.debug("reset for the new generation (place %s -> %s): %s", previous, place, done)
    return done
