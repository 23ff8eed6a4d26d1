"""WorldGroup on real gloo ranks, one process each, no Ray: the default group a loop holds follows it
into the survivors' group, and a loop's collective that fails is made again there, or not at all.

The survivors' `go_on` re-forms as worker/member.py does (leave, then join the next generation's
group); the real one parks at the supervisor first (tests/test_in_place.py covers it on Ray).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.worker.group.generation import GenerationGroup
from elastic_train.worker.group.world import WorldGroup, collectives_made, follow, generation_group, world_group
from tests.test_process_group import TIMEOUT_S, _assignment, _run


class _AllReduceInBackward(torch.autograd.Function):
    """A collective of the loop's own made inside autograd's backward (as a gradient reduction is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _survivors_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """4 ranks. Rank 3 exits before the loop's second all-reduce: ranks 0-2 go on at 3 and make it
    again there. Rank 2 then exits and the generation ends before a collective inside backward, and
    before an all-gather: neither goes on in place."""
    group = GenerationGroup("gloo", TIMEOUT_S, TIMEOUT_S, 1.0, in_place=True)
    group.join(_assignment(0, rank, world, ports[0]))
    first_default = world_group()
    went_on: list[str] = []
    foreign: list[bool] = []

    class Loop:
        def go_on_in_place(self, at: str) -> bool:
            went_on.append(at)
            group.leave()
            group.join(_assignment(1, rank, 3, ports[1]))
            return True

        def bound_to_world(self) -> None:
            foreign.append(True)

    follow(Loop())
    first = torch.tensor([rank + 1.0])
    dist.all_reduce(first)
    if rank == 3:
        control.set("3 exits", "1")
        os._exit(0)
    # As the supervisor does when it finds a worker lost: the survivors' group is aborted, whatever it was in.
    threading.Thread(target=lambda: (control.wait(["3 exits"]), group.abort(0)), daemon=True).start()
    second = torch.tensor([rank + 1.0])
    dist.all_reduce(second)  # fails on rank 3's loss, then made again over ranks 0-2
    seen = {"first": first.item(), "second": second.item(), "went_on": list(went_on),
            "world": dist.get_world_size(), "default": isinstance(dist.group.WORLD, WorldGroup),
            "first_default_size": first_default.size(), "rank_in_first": dist.get_rank(first_default),
            "calls": collectives_made(),
            "own_group_size": generation_group().size()}
    broadcast = torch.tensor([float(rank)])
    dist.broadcast(broadcast, src=0)
    seen["broadcast"] = broadcast.item()
    DistributedDataParallel(torch.nn.Linear(2, 2))  # built on the default group, not by prepare_model
    seen["foreign"] = list(foreign)
    if rank == 2:
        control.set("2 exits", "1")
        os._exit(0)
    control.wait(["2 exits"])
    group.abort(1)  # as the supervisor's end of the generation does: no survivor waits on rank 2
    x = torch.ones(2, requires_grad=True)
    try:
        _AllReduceInBackward.apply(x).sum().backward()
        seen["backward"] = "passed"
    except RuntimeError:
        seen["backward"] = "raised"
    gathered = [torch.zeros(1) for _ in range(3)]
    try:
        dist.all_gather(gathered, torch.tensor([float(rank)]))
        seen["all_gather"] = "passed"
    except RuntimeError:
        seen["all_gather"] = "raised"
    seen["went_on_after"] = list(went_on)
    control.set(f"done {rank}", "1")
    control.wait(["done 0", "done 1"])
    if rank == 1:
        control.set("1 left", "1")
    else:
        control.wait(["1 left"])  # rank 0 serves the control store: it stays until rank 1 is past its last wait
    return seen


@pytest.mark.timeout(120)
def test_a_loops_all_reduce_is_made_again_over_the_survivors_and_only_where_it_can_be():
    results = _run(_survivors_scenario, world=4, generations=2, reporting=[0, 1])
    for seen in results:
        assert seen["first"] == 1 + 2 + 3 + 4
        assert seen["second"] == 1 + 2 + 3, "made again over the survivors, from the inputs it had"
        assert seen["went_on"] == ["collective"]
        assert seen["world"] == seen["own_group_size"] == seen["first_default_size"] == 3
        assert seen["default"]
        assert seen["rank_in_first"] in (0, 1), "a group taken before going on in place answers the new world"
        assert seen["calls"] == 2
        assert seen["foreign"] == [True], "a DDP on the default group divides by the size it was built at"
        assert seen["broadcast"] == 0.0
        assert seen["backward"] == "raised", "a collective inside backward must unwind, not go on"
        assert seen["all_gather"] == "raised", "an all-gather's outputs are sized by the old world"
        assert seen["went_on_after"] == ["collective"], "neither failure may go on in place"


@pytest.mark.timeout(30)
def test_operations_not_made_again_are_passed_through():
    for name in ("_allgather_base", "gather", "scatter", "reduce_scatter", "alltoall_base", "send",
                 "recv"):
        assert getattr(WorldGroup, name) is not getattr(dist.ProcessGroup, name), name
