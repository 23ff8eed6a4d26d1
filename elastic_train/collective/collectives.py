"""Ray Train's `ray.train.collective.collectives`: a barrier and a broadcast from rank 0 across the
ranks of the current generation.

They go through the supervisor, not torch.distributed: they work whatever the backend, and a rank
waiting for a peer that is lost unwinds at once with its generation (the loop is re-entered at the
new world size), as `report()` does. For small data (Ray limits it to about 1 KB; here it travels
through the supervisor actor, so keep it small too). Every rank must make the same calls, or the
waiting ones fail after `ElasticConfig.collective_timeout_s`.
"""

from __future__ import annotations

from typing import TypeVar

from elastic_train.worker.loop.current import get_session

T = TypeVar("T")


def broadcast_from_rank_zero(data: T) -> T:
    """Rank 0's `data`, returned on every rank once every rank has called this (a barrier too)."""
    return get_session("collective.broadcast_from_rank_zero").collective(data)


def barrier() -> None:
    """Return once every rank of the current generation has called `barrier()`."""
    get_session("collective.barrier").collective()


__all__ = ["broadcast_from_rank_zero", "barrier"]
