"""The process's default group while loops may go on in place: it follows the loop across generations.

A loop's own collectives name the default group implicitly (`dist.all_reduce(loss)`, `dist.barrier()`,
`broadcast_object_list`). When a peer is lost and the survivors go on in place (worker/loop/session.py
`go_on_in_place`), those must follow the loop into the next generation unseen. Each generation's
default group is a `WorldGroup`, in the shape of torchft's wrappers: a Python `ProcessGroup` whose
collectives run on the group of the generation the loop is in now (worker/group/generation.py makes it), even
when the object was taken in an earlier one. An all-reduce, a broadcast or reduce from rank 0, or a
barrier that fails is made again from the same inputs on the group re-formed in place. Any other
operation's failure (its result's shape depends on the world, or a peer is named) unwinds the loop,
as does a collective made inside autograd's backward (a gradient reduction that is not ours: one
bucket made again over fewer ranks would mix two divisors). A DDP built on the default group (not by
`prepare_model`) divides its gradients by the world size it was built at, so the loop that builds
one is re-entered at every recovery; so is one whose model FSDP shards (its first gradient reduce-scatter
says so: each rank holds its share of the world it was built at). Our own collectives (a report's barrier, the gradient buckets,
a newcomer's state) run on `generation_group()` and handle their failures where they are made.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from elastic_train.faithful.reads import record

logger = logging.getLogger(__name__)

_GLOO = dist.ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")
_DDP_INIT = DistributedDataParallel.__init__.__code__
# The loop's reads of its place through torch: `dist.get_rank()`, `dist.get_world_size()`, and a
# `DistributedSampler` built without them (faithful/reads.py); torch's own reads elsewhere are not the loop's.
_READERS = frozenset(f.__code__ for f in (c10d.get_rank, c10d.get_world_size, c10d._get_group_size,
                                          DistributedSampler.__init__))


class Loop(Protocol):
    """The running loop's session, as the default group asks it."""

    def go_on_in_place(self, at: str) -> bool: ...

    def generation_ended(self) -> bool: ...

    def bound_to_world(self) -> None: ...


class _Following:
    """What the generations' WorldGroups share."""

    def __init__(self) -> None:
        self.current: dist.ProcessGroup | None = None  # the generation's gloo group the loop is in
        self.loop: Loop | None = None  # while a loop runs
        self.thread: int | None = None  # the loop's
        self.calls = 0  # collectives made so far: survivors compare where they stand (protocol.Position)
        self.groups: weakref.WeakSet[WorldGroup] = weakref.WeakSet()  # every generation's, still held


_following = _Following()


class CompletedWork(dist._Work):
    """An operation already completed here."""

    def __init__(self, result: Any):
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class WorldGroup(dist.ProcessGroup):
    """The default group of one generation, following the loop into the later ones it goes on in."""

    def __init__(self, current: dist.ProcessGroup):
        super().__init__(current.rank(), current.size())  # what C++ callers read: this generation's
        self._set_default_backend(_GLOO)  # C++ callers (DDP's construction log) ask for a backend by device
        self._register_backend(_CPU, _GLOO, current._get_backend(_CPU))

    def rank(self) -> int:
        rank = _following.current.rank()
        record("rank", rank, sys._getframe(1), _READERS)
        return rank

    def size(self) -> int:
        size = _following.current.size()
        record("world_size", size, sys._getframe(1), _READERS)
        return size

    def getBackendName(self) -> str:
        return "gloo"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return run(lambda g: g.allreduce(tensors, _opts(opts, dist.AllreduceOptions)), tensors, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return run(lambda g: g.allreduce_coalesced(tensors, _opts(opts, dist.AllreduceCoalescedOptions)), tensors,
                   tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.BroadcastOptions)
        if opts.rootRank != 0:
            return _following.current.broadcast(tensors, opts)
        return run(lambda g: g.broadcast(tensors, opts), tensors, tensors, "rooted")

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = _opts(opts, dist.ReduceOptions)
        if opts.rootRank != 0:
            return _following.current.reduce(tensors, opts)
        return run(lambda g: g.reduce(tensors, opts), tensors, tensors, "rooted")

    def barrier(self, opts: Any = None) -> dist.Work:
        return run(lambda g: g.barrier(_opts(opts, dist.BarrierOptions)), [], None)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *opts: Any) -> dist.Work:
        if _building_ddp() and _following.loop is not None:  # DDP's check of the parameters' shapes, as it is built
            logger.info("the loop built DDP on the default group: every recovery re-enters the loop")
            _following.loop.bound_to_world()
        return _following.current.allgather(outputs, inputs, *opts)


def _delegated(name: str) -> Callable[..., dist.Work]:
    def operation(self: WorldGroup, *args: Any) -> dist.Work:
        if name in _SHARDING and _following.loop is not None and _following.thread == threading.get_ident():
            _following.loop.bound_to_world()  # FSDP's gradient reduce-scatter: the loop's model is sharded
        return getattr(_following.current, name)(*args)

    operation.__name__ = name
    operation.__doc__ = f"`{name}` on the current generation's group; a failure unwinds the loop."
    return operation


_SHARDING = ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced")
for _name in ("_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter",
              "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
              "send", "recv", "recv_anysource"):
    setattr(WorldGroup, _name, _delegated(_name))


def run(op: Callable[[dist.ProcessGroup], dist.Work], changed: list[torch.Tensor], result: Any,
        at: str = "collective") -> dist.Work:
    """`op` on the current generation's group, waited for; after a failure, again from the same
    `changed` inputs (a failed all-reduce may have written partial sums into them) on the group
    re-formed in place, if the loop can go on in place `at` this collective. Where it cannot (no loop
    runs, or not on this thread), the group's own work, not waited for: its failure unwinds the loop.
    A collective of the loop's inside autograd's backward reduces gradients in a way not ours: the
    loop is re-entered at every recovery from then on."""
    loop = _following.loop
    if loop is None or _following.thread != threading.get_ident():
        return op(_following.current)
    if at != "ddp" and torch._C._current_graph_task_id() != -1:
        loop.bound_to_world()
        return op(_following.current)
    before = [t.clone() for t in changed]
    while True:
        try:
            op(_following.current).wait()
            if error := ended_alone(loop):
                raise error
            _following.calls += 1
            return CompletedWork(result)
        except RuntimeError:  # a failed collective (DistError is one); an argument's error is raised at once
            if not loop.go_on_in_place(at):
                raise
            logger.info("a collective of the loop is made again over the %d ranks that went on in place",
                        _following.current.size())
            for tensor, saved in zip(changed, before):
                tensor.copy_(saved)


def ended_alone(loop: Loop) -> RuntimeError | None:
    """The failure a peer's loss would raise in a group of one whose generation the supervisor ended
    (a replacement is ready to bring the run back to its size): an abort fails collectives by shutting
    the connections to peers (worker/group/generation.py), and a world of one has none, so without this check
    its loop would train on to its next report, to have those steps thrown away."""
    if _following.current.size() == 1 and loop.generation_ended():
        return RuntimeError("the generation ended: its group of one was aborted")
    return None


def _building_ddp() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _DDP_INIT:
            return True
        frame = frame.f_back
    return False


def _opts(opts: Any, kind: type) -> Any:
    return kind() if opts is None else opts


def install(current: dist.ProcessGroup) -> WorldGroup:
    """Make a `WorldGroup` on `current` (the generation's group, just made default by
    `init_process_group`, and still registered for teardown under its own name) the default group.
    The earlier generations' WorldGroups a loop still holds are registered again, for the new world."""
    _following.current = current
    world = WorldGroup(current)
    _following.groups.add(world)
    c10d._update_default_pg(world)
    registry = c10d._world
    for group in _following.groups:
        registry.pg_map[group] = registry.pg_map[current]
        registry.pg_names[group] = registry.pg_names[current]  # functional collectives resolve it by name
        registry.pg_backend_config[group] = registry.pg_backend_config[current]
        registry.pg_to_tag[group] = registry.pg_to_tag[current]
        registry.pg_group_ranks[group] = {i: i for i in range(current.size())}
    return world


def forget() -> None:
    """The generation's group is being torn down (worker/group/generation.py `leave`): let go of it here."""
    _following.current = None


def follow(loop: Loop | None) -> None:
    """`loop`'s session runs on this thread from now (None: no loop runs)."""
    _following.loop, _following.thread = loop, threading.get_ident() if loop is not None else None


def collectives_made() -> int:
    """The collectives the loops of this process made on the default group so far (where it follows them)."""
    return _following.calls


def world_group() -> WorldGroup | None:
    """The default group, if it is a `WorldGroup`."""
    group = c10d._world.default_pg
    return group if isinstance(group, WorldGroup) else None


def generation_group() -> dist.ProcessGroup:
    """The current generation's own group, for collectives whose failures are handled where they are made."""
    return _following.current if world_group() is not None else c10d._get_default_group()
