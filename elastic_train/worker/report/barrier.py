"""`report()`'s barrier, over the generation's own process group.

Every rank calls `report()` alike (as in Ray Train), and reports are made in lockstep: no rank
leaves report `k + 1` before every rank has made report `k`, so a lost peer's last report is at
most one behind the survivors'. The barrier is one all-reduce of a few flags (`Agreement`) over the
group the loop already has, carrying what every rank must decide alike: a checkpoint for the
supervisor to decide on, an unwind (the group is being resized), which ranks report parts (each
rank's bit: a survivor's report then tells the supervisor who held a part, and a rank that died
with its report on the way took none with it), a live part due to be stored, and on gloo the bytes
each rank sends its buddy (worker/report/part_exchange.py). A plain report issues its all-reduce and returns, the
next report waits for it; a report that must decide waits at once. docs/report_barrier.md: the flags
and the costs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from elastic_train.worker.group.world import generation_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agreed:
    """What every rank decided together at one report."""

    checkpoint: bool  # some rank reports a checkpoint the supervisor decides on
    unwind: bool  # some rank was asked to unwind at this report
    every_part: bool  # every rank reports a checkpoint part
    store_live: bool  # some rank's live dict part is due to be stored
    some_part: bool = False  # some rank reports a checkpoint part
    grow: bool = False  # some rank was asked to leave at the first report that carries a checkpoint (newcomers join)
    part_ranks: tuple[int, ...] = ()  # the ranks that report a checkpoint part
    # By rank, the bytes of the part each sends its buddy at this report (worker/report/part_exchange.py); empty
    # where no part is exchanged (NCCL, or alone).
    sends: tuple[int, ...] = ()

    @property
    def round_trip(self) -> bool:
        """Must every rank ask the supervisor at this report? For a checkpoint it decides on, or a live
        part due to be stored that not every rank holds (the supervisor names who stores it). When every
        rank holds a live dict part, rank 0's is all of it: rank 0 stores it, and no one asks."""
        return self.checkpoint or (self.store_live and not self.every_part)

    @property
    def notable(self) -> bool:
        """Did some rank bring anything but metrics (and a state kept live)? Then every rank waits for
        the next report's agreement at once."""
        return self.checkpoint or self.unwind or self.some_part or self.store_live or self.grow


def goes_on(plain: bool, unwind_due: bool, previous: Agreed | None, pipelined: bool) -> bool:
    """May this rank leave its report before the others made it, its agreement awaited at the next
    report? Only a plain report (no checkpoint) with no unwind due, after a plain one (or one that
    carried a state kept live), in a `pipelined` group (`pipelines`). The first report of a
    generation waits: no rank knows a previous one."""
    return pipelined and plain and not unwind_due and previous is not None and not previous.notable


def all_wait(previous: Agreed | None, pipelined: bool, unwind_alike: bool = False) -> bool:
    """Does every rank wait for this report's agreement at once, so that all may act on it now?
    `unwind_alike`: every rank's loop asked to unwind at this report (`get_preemption_info()` answers
    every rank alike), so none goes on."""
    return not pipelined or previous is None or previous.notable or unwind_alike


def pipelines() -> bool:
    """Do plain reports go on before their barrier passes in this generation's group? On gloo with
    peers. Not alone (there is no barrier to wait for), and not on NCCL: its result is read on the
    host after the step's kernels, and the kept state's commit (worker/report/lockstep.py) already agrees
    once a step."""
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"


_FLAGS = 6  # checkpoint, unwind, no part, store_live, part, grow; then the part holders' bits, then the sends
_BITS = 62  # ranks per int64 word of the part holders' bits (a sum of distinct bits is their union)


class Agreement:
    """One report's flags, all-reduced (SUM: a flag is set where some rank set it) over the group:
    issued by `issue`, read by `result`."""

    def __init__(self, flags: torch.Tensor, words: int, work: dist.Work | None):
        self._flags = flags
        self._words = words  # of the part holders' bits
        self._work = work  # None: a group of one, the flags are already the answer

    def result(self) -> Agreed:
        """Wait for the all-reduce (bounded by the group's timeout); raises if it failed."""
        if self._work is not None:
            self._work.wait()
        return self._read()

    def _read(self) -> Agreed:
        values = self._flags.tolist()
        any_checkpoint, any_unwind, some_without, any_store_live, any_part, any_grow = values[:_FLAGS]
        holders = values[_FLAGS:_FLAGS + self._words]
        part_ranks = tuple(word * _BITS + bit for word, bits in enumerate(holders) for bit in range(_BITS) if bits >> bit & 1)
        return Agreed(bool(any_checkpoint), bool(any_unwind), not some_without, bool(any_store_live), bool(any_part),
                      bool(any_grow), part_ranks, tuple(values[_FLAGS + self._words:]))

    def on_passed(self, fn: Callable[[Agreed], None]) -> None:
        """Call `fn` with the agreement once the all-reduce passed, on the thread that completes it
        (now, if it did already); never if it failed."""
        def passed(future: torch.futures.Future) -> None:
            try:
                future.value()
            except Exception:  # noqa: BLE001 - a failed all-reduce: `result()` raises it to the loop
                return
            try:
                fn(self._read())  # not `result()`: its wait may be what this completion is about to release
            except Exception:  # noqa: BLE001 - a callback's error must not vanish into the future
                logger.exception("acting on a report's agreement failed")

        if self._work is None:
            fn(self.result())
        else:
            self._work.get_future().then(passed)


def issue(checkpoint: bool, unwind: bool, part: bool, store_live: bool, grow: bool = False,
          sends: int = 0) -> Agreement:
    """Start the all-reduce of this rank's flags, and of the bytes it `sends` its buddy (on gloo)."""
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    # NCCL reduces on this worker's GPU (its default group has no CPU path); reading the result waits for it.
    nccl = not alone and dist.get_backend() == "nccl"
    rank, size = (0, 1) if alone else (dist.get_rank(generation_group()), dist.get_world_size(generation_group()))
    holders = [0] * -(-size // _BITS)
    if part:
        holders[rank // _BITS] = 1 << rank % _BITS
    sent = [0] * size if pipelines() else []  # parts are exchanged over gloo groups of two or more
    if sent:
        sent[rank] = sends
    flags = torch.tensor([int(checkpoint), int(unwind), int(not part), int(store_live), int(part), int(grow), *holders,
                          *sent], dtype=torch.int64,
                         device=torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    return Agreement(flags, len(holders),
                     None if alone else dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True, group=generation_group()))


def every_rank(*flags: bool) -> tuple[bool, ...]:
    """Is each of `flags` set on every rank? A small all-reduce over the generation's group, waited
    for; raises what a failed collective raises."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flags
    nccl = dist.get_backend() == "nccl"
    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32,
                          device=torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=generation_group())
    return tuple(bool(v) for v in values.tolist())


def agree(checkpoint: bool, unwind: bool, part: bool, store_live: bool, grow: bool = False,
          sends: int = 0) -> Agreed:
    """The group's decision from this rank's flags, waited for: a barrier."""
    return issue(checkpoint, unwind, part, store_live, grow, sends).result()


def collectives_done() -> int | None:
    """How many collectives this rank has made over the generation's group (its sequence number);
    None when the group cannot tell (gone, or aborted).

    A report whose barrier failed can still count when the step before it made a collective with
    every peer (DDP's gradient all-reduce): each rank's share of the step is then in the state."""
    if not dist.is_initialized():
        return 0
    try:
        return generation_group()._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - an aborted group may refuse: then no step is taken as witnessed
        return None
