"""The process group `prepare_model` hands DDP: it follows the loop from generation to generation.

DDP binds to one process group for good, and makes collectives of its own on it besides the
gradients' (which go through the comm hook, worker/group/reduction.py): the parameters' broadcast and shape check
as it is built, the buffers' broadcast before each forward (BatchNorm's statistics, with the default
`broadcast_buffers`), the map of used parameters after each backward (`find_unused_parameters`),
and the buckets' rebuild after the first step. Each of them runs on the process's default group,
which follows the loop from generation to generation (worker/group/world.py); one that fails (a peer
lost) is made again, from the same inputs, on the group re-formed in place (worker/loop/session.py
`go_on_in_place`), so none fails under the loop, not even inside autograd's backward, where the
default group lets no failure of the loop's own go on in place.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker.group.world import WorldGroup, generation_group, run


class DDPGroup(WorldGroup):
    """DDP's process group: a `WorldGroup` whose collectives are DDP's. Those that fail
    inside autograd's backward (the map of used parameters) go on in place too, as do its broadcasts
    (rank 0's buffers) whichever rank is rank 0 now: each rank's input is its own copy. Its all-gather
    (the shape check as it is built) is not made again: its outputs are one per rank of the world it
    began in, and a loop that loses a peer before it has a model has nothing to go on from."""

    def __init__(self) -> None:
        super().__init__(generation_group())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return run(lambda group: group.allreduce(tensors, opts), tensors, tensors, "ddp")

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return run(lambda group: group.broadcast(tensors, opts), tensors, tensors, "ddp")

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return generation_group().allgather(outputs, inputs, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return run(lambda group: group.barrier(opts) if opts is not None else group.barrier(), [], None, "ddp")


class ElasticDDP(DistributedDataParallel):
    """DDP on an `DDPGroup`. Copied or pickled (`copy.deepcopy(model)`, as Ray's own linear example
    does to keep the validated model) as DDP on the default group is: the copy is DDP on the current
    generation's default group."""

    user_comm_hook = False  # the loop registered a comm hook of its own

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """The loop's own comm hook takes the place of the one that completes a step on the survivors
        (worker/group/reduction.py, registered at the first forward): a peer lost in the step's reduction then
        re-enters the loop."""
        self.user_comm_hook = True
        super().register_comm_hook(state, hook)

    def _check_default_group(self) -> None:
        if not isinstance(self.process_group, DDPGroup):
            super()._check_default_group()
