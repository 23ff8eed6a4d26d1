"""`report()`'s barrier, over the generation's own process group.

Every rank calls `report()` alike (as in Ray Train), and no rank may leave report `k` before every
rank has made it: then no rank runs a step past a lost peer's last report, so at most one step is
redone even in a loop with no collective. The supervisor used to be that barrier, a Ray round trip
per report (~5 ms a step on 2 cores). Here it is one all-reduce of a few flags over the group the
loop already has, which also carries what every rank must decide alike:

* `checkpoint`: some rank reports a checkpoint the supervisor decides on, so every rank takes the
  round trip through it, which decides whether it is stored and answers once it is recorded;
* `unwind`: some rank was asked to leave the loop at this report (the group is being resized):
  all ranks leave after the same report;
* `every_part`, `some_part`: every rank, some rank, reports a checkpoint part (a state kept live is
  not one: worker/kept_state.py);
* `store_live`: some rank holds a live dict part due to be stored (`CheckpointConfig.persist_due`).
  When every rank holds one, the ranks need no one to decide: rank 0 stores it, none takes a round trip.

A lost peer makes the all-reduce fail (gloo: its connection closes; a hung one: the supervisor
aborts the group); the loop then unwinds like any failed collective. Its wait is bounded by
`ElasticConfig.collective_timeout_s`, like every collective of the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreed:
    """What every rank decided together at one report."""

    checkpoint: bool  # some rank reports a checkpoint the supervisor decides on
    unwind: bool  # some rank was asked to unwind at this report
    every_part: bool  # every rank reports a checkpoint part
    store_live: bool  # some rank's live dict part is due to be stored
    some_part: bool = False  # some rank reports a checkpoint part

    @property
    def round_trip(self) -> bool:
        """Must every rank ask the supervisor at this report? For a checkpoint it decides on, or a live
        part due to be stored that not every rank holds (the supervisor names who stores it). When every
        rank holds a live dict part, rank 0's is all of it: rank 0 stores it, and no one asks."""
        return self.checkpoint or (self.store_live and not self.every_part)


def agree(checkpoint: bool, unwind: bool, part: bool, store_live: bool) -> Agreed:
    """The group's decision from this rank's flags: an all-reduce (MAX) of them, a barrier."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Agreed(checkpoint, unwind, part, store_live, part)
    # NCCL reduces on this worker's GPU (its default group has no CPU path); reading the result waits for it.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = torch.tensor([int(checkpoint), int(unwind), int(not part), int(store_live), int(part)], dtype=torch.int32,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_checkpoint, any_unwind, some_without, any_store_live, any_part = flags.tolist()
    return Agreed(bool(any_checkpoint), bool(any_unwind), not some_without, bool(any_store_live), bool(any_part))


def collectives_done() -> int | None:
    """How many collectives this rank has made over the generation's group (its sequence number);
    None when the group cannot tell (gone, or aborted).

    A report whose barrier failed can still count when the step before it made a collective with
    every peer (DDP's gradient all-reduce): each rank's share of the step is then in the state."""
    if not dist.is_initialized():
        return 0
    try:
        return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    except Exception:  # noqa: BLE001 - an aborted group may refuse: then no step is taken as witnessed
        return None
