"""One coordinator per Ray Data dataset, for the run's life: it runs each epoch's execution (Ray
Data's own streaming executor: `map_batches` on any node's CPUs, blocks in the object store) and
serves any rows of it, by their place in the epoch's order, to whichever rank asks.

It keeps no cursor: where each epoch stands is the ranks' (cursor.py), reported with every
`report()`. So the coordinator is a cache of executions, and Ray restarts it if it is lost
(`max_restarts=-1`): the restarted one executes the epoch again, in the same order (replay.py),
and serves on from the rows the ranks ask for. An execution that failed, or whose blocks were
lost, is executed anew when next asked for. Rows below what
any rank may still ask for (`release`) are let go; asked for again (a run restored from an older
checkpoint), the epoch is executed again up to them.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import ray

from elastic_train.ingest.blocks import EpochBlocks, Piece
from elastic_train.ingest.replay import run_at, seed_random_operators

logger = logging.getLogger(__name__)

EPOCHS_HELD = 2  # executions kept: ranks one step apart may stand either side of an epoch's end

Runs = list[tuple[int, int]]  # [begin, end) row ranges of one epoch's order


def _entries(bundle: Any) -> Iterator[tuple[Any, int, int]]:
    """(block ref, first row, rows) of each block a RefBundle delivers, its slices applied."""
    slices = getattr(bundle, "slices", None) or (None,) * len(bundle.blocks)
    for entry, piece in zip(bundle.blocks, slices):
        ref, metadata = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
        if piece is not None:
            yield ref, piece.start_offset, piece.end_offset - piece.start_offset
            continue
        rows = metadata.num_rows
        if rows is None:
            from ray.data.block import BlockAccessor

            rows = BlockAccessor.for_block(ray.get(ref)).num_rows()
        yield ref, 0, rows


class _Execution:
    """One epoch's execution as far as it went, and the blocks it gave that are still held."""

    def __init__(self, dataset: Any, kept_from: int):
        self.stream = iter(dataset.iter_internal_ref_bundles())
        self.blocks = EpochBlocks(kept_from=kept_from)

    def reach(self, row: int) -> None:
        """Pull blocks until the order has `row` rows or ends (raises what the execution raised)."""
        while self.blocks.rows < row and not self.blocks.ended:
            bundle = next(self.stream, None)
            if bundle is None:
                self.blocks.ended = True
                return
            for ref, first, rows in _entries(bundle):
                self.blocks.add((ref, first), rows)


class DatasetCoordinator:
    """Serves one dataset's epochs to the ranks (a Ray actor, restarted by Ray when lost)."""

    def __init__(self, dataset: Any, name: str, seed: int):
        self._dataset, self._name = dataset, name
        seed_random_operators(dataset, name, seed)
        self._executions: dict[int, _Execution] = {}

    def pieces(self, epoch: int, runs: Runs) -> list[list[Piece]]:
        """Where the rows of `runs` of epoch `epoch` lie, each run cut at the epoch's end."""
        lowest = min((begin for begin, end in runs if end > begin), default=None)
        execution = self._execution(epoch, lowest)
        found = []
        for begin, end in runs:
            try:
                execution.reach(end)
            except Exception:  # a failed execution is not served again: the next ask executes the epoch anew
                self._executions.pop(epoch, None)
                raise
            held = execution.blocks.pieces(begin, end)  # each held block is (its ref, the first row it gives)
            found.append([Piece(p.block[0], p.block[1] + p.offset, p.length) for p in held])
        return found

    def forget(self, epoch: int) -> None:
        """The blocks served for `epoch` were lost (their node, or their owner): execute it anew."""
        if self._executions.pop(epoch, None) is not None:
            logger.warning("dataset %r: blocks of epoch %d were lost; executing the epoch again", self._name, epoch)

    def release(self, epoch: int, below: int) -> None:
        """No rank will ask for rows of an epoch before `epoch`, nor for those below `below` in it."""
        for older in [e for e in self._executions if e < epoch]:
            del self._executions[older]
        if epoch in self._executions:
            self._executions[epoch].blocks.release(below)

    def _execution(self, epoch: int, lowest: int | None) -> _Execution:
        execution = self._executions.get(epoch)
        if execution is not None and (lowest is None or execution.blocks.serves(lowest)):
            return execution
        if execution is not None:
            logger.warning("dataset %r: rows from %d of epoch %d were let go; executing the epoch again",
                           self._name, lowest, epoch)
        for newer in [e for e in self._executions if e > epoch]:  # the ranks went back to an older epoch
            del self._executions[newer]
        run_at(self._dataset, epoch)
        execution = self._executions[epoch] = _Execution(self._dataset, lowest or 0)
        for older in sorted(self._executions)[:-EPOCHS_HELD]:
            del self._executions[older]
        return execution


__all__ = ["DatasetCoordinator", "Runs"]
