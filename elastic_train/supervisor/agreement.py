"""Calls that every rank of a generation makes alike and that must give every rank the same answer:
`get_preemption_info()`, `collective.barrier()`, `collective.broadcast_from_rank_zero()`.

They go through the supervisor rather than torch.distributed so that they work on any backend and,
like `report()`, unwind when the generation ends: a rank waiting for a peer that was lost is
answered at once (the loop is then re-entered in the next generation), instead of hanging on a
dead group. The first ranks to arrive wait for the last; the answer is decided once, when the last
one arrives, from what each rank brought.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable


@dataclass
class _Call:
    brought: dict[int, Any] = field(default_factory=dict)  # rank -> what it brought
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    answer: Any = None


class Agreements:
    """The calls in progress, by key (the kind of call, its generation and its number on each rank)."""

    def __init__(self) -> None:
        self._calls: dict[Hashable, _Call] = {}

    async def agree(self, key: Hashable, rank: int, world_size: int, brought: Any,
                    decide: Callable[[dict[int, Any]], Any], timeout_s: float, what: str, setting: str) -> Any:
        """`rank` makes call `key`: returns, once every rank made it, `decide(rank -> brought)`, taken
        when the last one arrived. Raises if the other ranks do not arrive within `timeout_s`: a loop
        that makes the call on some ranks only would hang. After `release()` it returns None."""
        call = self._calls.setdefault(key, _Call())
        call.brought[rank] = brought
        if len(call.brought) >= world_size:
            call.answer = decide(call.brought)
            del self._calls[key]
            call.answered.set()
            return call.answer
        try:
            await asyncio.wait_for(call.answered.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"{what} waited {setting}={timeout_s}s for ranks {sorted(set(range(world_size)) - set(call.brought))}: "
                "every rank must call it the same number of times (it is a barrier, as in Ray Train).") from None
        return call.answer

    def release(self) -> None:
        """The generation ended: calls waiting for their peers are answered (the callers then find
        their generation over and unwind)."""
        for call in self._calls.values():
            call.answered.set()
        self._calls.clear()
