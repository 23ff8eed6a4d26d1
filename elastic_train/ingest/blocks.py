"""Where each row of one epoch's execution lies: its blocks, in the order the execution gave them,
from the lowest row still wanted on. Pure: a block is whatever the caller holds for it (an
ObjectRef on the coordinator)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Piece:
    """Rows [offset, offset + length) of one block."""

    block: Any
    offset: int
    length: int


@dataclass
class EpochBlocks:
    """The blocks of one epoch's order seen so far; blocks wholly below `kept_from` are not held."""

    kept_from: int = 0  # the lowest row this index may serve
    starts: list[int] = field(default_factory=list)  # first row of each held block
    blocks: list[Any] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    rows: int = 0  # rows the execution gave so far (held or not)
    ended: bool = False  # the execution gave its last block

    def add(self, block: Any, length: int) -> None:
        """The execution's next block (not held if it lies wholly below `kept_from`)."""
        if length and self.rows + length > self.kept_from:
            self.starts.append(self.rows)
            self.blocks.append(block)
            self.lengths.append(length)
        self.rows += length

    def serves(self, begin: int) -> bool:
        """Can rows from `begin` on still be found here (or in blocks still to come)?"""
        return begin >= self.kept_from

    def pieces(self, begin: int, end: int) -> list[Piece]:
        """Rows [begin, min(end, rows)) as pieces of held blocks, in order."""
        if not self.serves(begin):
            raise ValueError(f"rows from {begin} were released (kept from {self.kept_from})")
        end = min(end, self.rows)
        found = []
        index = max(bisect.bisect_right(self.starts, begin) - 1, 0)
        while begin < end and index < len(self.blocks):
            start, length = self.starts[index], self.lengths[index]
            if begin < start + length:
                offset = begin - start
                taken = min(end, start + length) - begin
                found.append(Piece(self.blocks[index], offset, taken))
                begin += taken
            index += 1
        return found

    def release(self, below: int) -> None:
        """No row below `below` will be wanted: let go of the blocks wholly below it."""
        self.kept_from = max(self.kept_from, below)
        drop = bisect.bisect_right([s + n for s, n in zip(self.starts, self.lengths)], self.kept_from)
        del self.starts[:drop], self.blocks[:drop], self.lengths[:drop]


__all__ = ["EpochBlocks", "Piece"]
