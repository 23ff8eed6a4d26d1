"""The process group `prepare_model` hands DDP: it follows the loop from generation to generation.

DDP binds to one process group for good, and makes collectives of its own on it besides the
gradients' (which go through the comm hook, reduction.py): the parameters' broadcast and shape check
as it is built, the buffers' broadcast before each forward (BatchNorm's statistics, with the default
`broadcast_buffers`), the map of used parameters after each backward (`find_unused_parameters`),
and the buckets' rebuild after the first step. Each of them runs here on the default group of the
generation the loop is in; one that fails (a peer lost) is made again, from the same inputs, on the
group re-formed in place (worker/session.py `go_on_in_place`), so none fails under the loop. As in
torchft's wrappers, the operations are those of a Python `ProcessGroup`; unlike them, this one holds
no group of its own: the generation's is the process's default one (worker/process_group.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker.session import TrainSession

logger = logging.getLogger(__name__)

_GLOO = dist.ProcessGroup.BackendType.GLOO
_CPU = torch.device("cpu")


class _Done(dist._Work):
    """An operation already completed here."""

    def __init__(self, result: Any):
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class ElasticGroup(dist.ProcessGroup):
    """DDP's process group: the current generation's default group, re-formed in place under a failure."""

    def __init__(self, session: TrainSession):
        current = _get_default_group()
        super().__init__(current.rank(), current.size())
        self._session = session
        # DDP's construction log asks the group for its backend by device: the generation's gloo.
        self._set_default_backend(_GLOO)
        self._register_backend(_CPU, _GLOO, current._get_backend(_CPU))

    def rank(self) -> int:
        return _get_default_group().rank()

    def size(self) -> int:
        return _get_default_group().size()

    def getBackendName(self) -> str:
        return "gloo"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run(lambda group: group.allreduce(tensors, opts), tensors, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run(lambda group: group.broadcast(tensors, opts), tensors, tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run(lambda group: group.allgather(outputs, inputs, opts), [], outputs)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run(lambda group: group.barrier(opts) if opts is not None else group.barrier(), [], None)

    def _run(self, op: Callable[[dist.ProcessGroup], dist.Work], changed: list[torch.Tensor], result: Any) -> dist.Work:
        """`op` on the current group, waited for; after a failure, again from the same `changed` inputs
        (a failed all-reduce may have written partial sums into them) on the group re-formed in place."""
        before = [t.clone() for t in changed]
        while True:
            try:
                op(_get_default_group()).wait()
                return _Done(result)
            except Exception:
                if not self._session.go_on_in_place("ddp"):
                    raise
                logger.info("one of DDP's collectives is made again over the %d ranks that went on in place",
                            dist.get_world_size())
                for tensor, saved in zip(changed, before):
                    tensor.copy_(saved)


class ElasticDDP(DistributedDataParallel):
    """DDP on an `ElasticGroup`. Copied or pickled (`copy.deepcopy(model)`, as Ray's own linear example
    does to keep the validated model) as DDP on the default group is: the copy is DDP on the current
    generation's default group."""

    user_comm_hook = False  # the loop registered a comm hook of its own

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """The loop's own comm hook takes the place of the one that completes a step on the survivors
        (reduction.py, registered at the first forward): a peer lost in the step's reduction then
        re-enters the loop."""
        self.user_comm_hook = True
        super().register_comm_hook(state, hook)

    def _check_default_group(self) -> None:
        if not isinstance(self.process_group, ElasticGroup):
            super()._check_default_group()
