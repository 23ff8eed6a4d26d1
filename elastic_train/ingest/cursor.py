"""Where one epoch stands, alike on every rank: what a data loader must remember to go on exactly
once after a resize.

An epoch is one order of rows (a seeded permutation of a torch dataset, or a Ray Data execution's
output). Step k trains global batch k: the rows owed to the epoch first (those only lost ranks
drew), then the order's from `position` on, split contiguously across the ranks (`share`). The
cursor's state is reported with every `report()`, so a loop re-entered from a report goes on from
the same global row; a loop going on in place owes the epoch what its lost ranks drew but did not
train. Pure: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from elastic_train.faithful import reads

Shares = list[list[int]]  # each rank's rows of one global batch, by rank


def share_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Where rank `rank`'s contiguous share of a global batch of `size` rows lies (shares differ by one
    row at most; with fewer rows than ranks, a rank without one takes the last row, so that every rank
    takes the step)."""
    base, extra = divmod(size, world_size)
    begin = rank * base + min(rank, extra)
    end = begin + base + (1 if rank < extra else 0)
    return (begin, end) if end > begin else (size - 1, size)


def share(chunk: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s rows of global batch `chunk` (see `share_bounds`)."""
    begin, end = share_bounds(len(chunk), rank, world_size)
    return list(chunk[begin:end])


def untrained(batches: list[Shares], survivors: tuple[int, ...]) -> list[int]:
    """The rows of `batches` that only ranks not among `survivors` held: owed to the epoch."""
    owed = []
    for shares in batches:
        kept = {i for rank in survivors for i in shares[rank]}
        owed.extend(i for rank, held in enumerate(shares) if rank not in survivors for i in held if i not in kept)
    return owed


class Cursor:
    """One loader's place in its epochs: the epoch, the order's next row (`position`), the rows owed to
    the epoch, and the global batches drawn since every rank last trained all drawn."""

    def __init__(self) -> None:
        self.epoch, self.position, self.owed = 0, 0, []
        self.size: int | None = None  # rows in the epoch's order, once its end was seen
        self.drawn: list[Shares] = []
        self.started = False  # an epoch was entered: the next one is a new epoch
        self.ended = False  # the epoch's order was walked to its end

    def resume_from(self, state: dict[str, Any] | None) -> None:
        if state:
            self.epoch, self.position, self.owed = state["epoch"], state["position"], list(state.get("owed", []))
            self.size = state.get("size")

    def state(self) -> dict[str, Any]:
        """What a report records: where the loop re-entered from it goes on."""
        if self.ended and not self.owed:
            return {"epoch": self.epoch + 1, "position": 0}
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position}
        if self.owed:
            state["owed"] = list(self.owed)
        if self.size is not None:
            state["size"] = self.size
        return state

    def lowest_row(self) -> tuple[int, int]:
        """(epoch, row): the earliest row of the order this state may still draw."""
        state = self.state()
        return state["epoch"], min([state["position"], *state.get("owed", [])])

    def enter(self) -> None:
        """An epoch's iteration starts: the next epoch, unless this is the first (the resumed one)."""
        if self.started:
            self.epoch, self.position, self.owed, self.size, self.ended = self.epoch + 1, 0, [], None, False
        self.started = True
        self.drawn.clear()

    def end(self) -> None:
        """The epoch's order was walked to its end, and nothing is owed."""
        self.ended, self.owed = True, []

    def draw(self, chunk: list[int], world_size: int) -> Shares:
        """Global batch `chunk` was drawn: it leaves the owed rows and the order's; returns its shares."""
        reads.drawn()  # a step of the loop may begin (faithful/reads.py)
        taken = min(len(chunk), len(self.owed))
        self.owed = self.owed[taken:]
        self.position += len(chunk) - taken
        shares = [share(chunk, rank, world_size) for rank in range(world_size)]
        self.drawn.append(shares)
        return shares

    def trained(self) -> None:
        """Every rank trained the batches drawn so far."""
        self.drawn.clear()

    def reformed(self, previous_ranks: tuple[int, ...]) -> None:
        """The loop goes on in place (`previous_ranks`: each new rank's previous one): the rows of the
        batches drawn since the last `trained` that only the lost ranks held come first in the rest of
        the epoch. The survivors' shares stay drawn: a peer lost later in the same step owes its."""
        self.owed = untrained(self.drawn, previous_ranks) + self.owed
        self.drawn = [[shares[r] for r in previous_ranks] for shares in self.drawn]


@dataclass(frozen=True)
class StepPlan:
    """Which rows the next step draws, as the cursor stands: alike on every rank."""

    epoch: int
    owed: tuple[int, ...]  # owed rows it takes, in order
    position: int  # the order's rows it takes next, from here ...
    fresh: int  # ... at most this many
    rank: int
    world_size: int

    def runs(self) -> list[tuple[int, int]]:
        """The global batch's rows as [begin, end) runs, in order: the owed ones, then the fresh (last,
        maybe empty)."""
        runs: list[tuple[int, int]] = []
        for row in self.owed:
            if runs and runs[-1][1] == row:
                runs[-1] = (runs[-1][0], row + 1)
            else:
                runs.append((row, row + 1))
        return runs + [(self.position, self.position + self.fresh)]

    def chunk(self, found: int) -> list[int]:
        """The global batch, where the order had `found` of the fresh rows asked for."""
        return list(self.owed) + list(range(self.position, self.position + found))

    def size(self, found: int) -> int | None:
        """The rows in the epoch's order, where `found` fresh rows show its end; else None."""
        return self.position + found if found < self.fresh else None


def plan_step(cursor: Cursor, global_batch: int, rank: int, world_size: int) -> StepPlan:
    """The next step's rows: the owed first, then the order's, up to its end where that is known."""
    owed = tuple(cursor.owed[:global_batch])
    fresh = global_batch - len(owed)
    if cursor.size is not None:
        fresh = max(min(fresh, cursor.size - cursor.position), 0)
    return StepPlan(cursor.epoch, owed, cursor.position, fresh, rank, world_size)


__all__ = ["Cursor", "Shares", "StepPlan", "plan_step", "share", "share_bounds", "untrained"]
