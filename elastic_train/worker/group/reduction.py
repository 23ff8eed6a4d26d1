"""DDP's gradient reduction, whole across a lost peer: the comm hook `prepare_model` registers.

Each bucket is all-reduced on the generation's group as DDP's own reduction does (each rank's
gradients divided by the world size, then summed), while the rank's local gradients stay in the
bucket until the step's last bucket is reduced. When an all-reduce fails, the loop does not see it:
the session parks inside the loop (worker/loop/session.py `go_on_in_place`) and, once the survivors'
group re-forms in place, every bucket of the step is reduced again there from the local gradients,
divided by the new world size. The optimizer step that follows uses one consistent gradient: no
bucket averaged over N ranks and another over N - 1. (DDP's other collectives follow the loop through
its process group, worker/group/ddp.py.) Where the loop cannot go on in place, the buckets' futures fail
with the collective's error and the loop unwinds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker.group.world import Loop, ended_alone, generation_group

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    """One bucket of the step: the rank's local gradients, their share being reduced, DDP's future."""

    local: torch.Tensor
    reduced: torch.Tensor
    work: dist.Work | None  # None: the all-reduce could not even start
    future: torch.futures.Future


class Stepping(Loop, Protocol):
    """The running loop's session, as the step's reduction tells it of the steps it reduces."""

    def reduces_steps(self) -> None: ...

    def reduced(self) -> None: ...


class StepReduction:
    """The comm hook of one DDP model in one loop."""

    def __init__(self, session: Stepping):
        self._session = session
        self._buckets: list[_Bucket] = []

    def register(self, ddp: DistributedDataParallel) -> None:
        """Register the hook as the model's first forward begins, unless the loop registered a comm hook
        of its own by then (`ElasticDDP.register_comm_hook`): the step's reduction is then the loop's,
        and a peer lost in it re-enters the loop."""
        def first_forward(module: torch.nn.Module, args: object) -> None:
            if module is not ddp:  # a copy of the model (copy.deepcopy) reduces as plain DDP
                return
            handle.remove()
            if not getattr(ddp, "user_comm_hook", False):
                DistributedDataParallel.register_comm_hook(ddp, None, self._hook)
                self._session.reduces_steps()

        handle = ddp.register_forward_pre_hook(first_forward)

    def __deepcopy__(self, memo: dict) -> StepReduction:
        """A copy of the model (`copy.deepcopy(ddp)`) shares this service: it holds the loop's session."""
        return self

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations as objects, not strings
        """DDP's comm hook: (state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]."""
        del state
        local = bucket.buffer()
        reduced, work = _start(local)
        this = _Bucket(local, reduced, work, torch.futures.Future())
        self._buckets.append(this)
        if bucket.is_last():  # DDP waits for every bucket's future right after the last one's hook
            self._complete()
        return this.future

    def _complete(self) -> None:
        buckets, self._buckets = self._buckets, []
        error = _wait_all(buckets, self._session)
        while error is not None:
            if not self._session.go_on_in_place("gradients"):
                for b in buckets:
                    b.future.set_exception(error)
                return
            logger.info("the step's gradients are reduced again over the %d ranks that went on in place",
                        dist.get_world_size())
            for b in buckets:
                b.reduced, b.work = _start(b.local)
            error = _wait_all(buckets, self._session)
        self._session.reduced()
        for b in buckets:
            b.future.set_result(b.reduced)


def _start(local: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
    """Start the all-reduce of `local`'s share over the group: divided by the world size, then summed."""
    reduced = local / dist.get_world_size()
    try:
        return reduced, dist.all_reduce(reduced, async_op=True, group=generation_group())
    except Exception:  # noqa: BLE001 - the group failed already: `_wait_all` finds no work to wait for
        logger.debug("the all-reduce of a gradient bucket could not start", exc_info=True)
        return reduced, None


def _wait_all(buckets: list[_Bucket], session: Loop) -> Exception | None:
    """Wait for every bucket's all-reduce, the failed ones too (none then writes after the wait);
    the first failure (or the end of a group of one's generation), or None if all passed."""
    error: Exception | None = None
    for b in buckets:
        try:
            if b.work is None:
                raise RuntimeError("gloo: the all-reduce of a gradient bucket could not start: the group failed")
            b.work.wait()
        except Exception as exc:  # noqa: BLE001 - a lost peer: handled by the caller, after every wait
            error = error or exc
    return error or ended_alone(session)

