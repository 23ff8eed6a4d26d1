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

Each execution is read ahead of the ranks, by a thread of its own, up to `READ_AHEAD_BYTES` of
blocks held: Ray Data's executor loops without pause while its output waits to be taken and no task
runs (`process_completed_tasks` waits only on active tasks), which took 0.3 CPU-seconds an epoch here
(two-thirds of a core) for an epoch of 64 rows served over 0.4 s. Taken as it comes, the execution
ends and stops; a larger epoch is held no further than the budget ahead of the ranks.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator

import ray

from elastic_train.ingest.blocks import EpochBlocks, Piece
from elastic_train.ingest.replay import run_at, seed_random_operators

logger = logging.getLogger(__name__)

EPOCHS_HELD = 2  # executions kept: ranks one step apart may stand either side of an epoch's end
READ_AHEAD_BYTES = 256 * 2**20  # an execution's blocks held ahead of the ranks (see the module's docstring)

Runs = list[tuple[int, int]]  # [begin, end) row ranges of one epoch's order


def _entries(bundle: Any) -> Iterator[tuple[Any, int, int, int]]:
    """(block ref, first row, rows, bytes) of each block a RefBundle delivers, its slices applied."""
    slices = getattr(bundle, "slices", None) or (None,) * len(bundle.blocks)
    for entry, piece in zip(bundle.blocks, slices):
        ref, metadata = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
        size = metadata.size_bytes or 0
        if piece is not None:
            yield ref, piece.start_offset, piece.end_offset - piece.start_offset, size
            continue
        rows = metadata.num_rows
        if rows is None:
            from ray.data.block import BlockAccessor

            rows = BlockAccessor.for_block(ray.get(ref)).num_rows()
        yield ref, 0, rows, size


class _Execution:
    """One epoch's execution as far as it went, and the blocks it gave that are still held (each held
    as (ref, its first row, its bytes)), read ahead by a thread (see the module's docstring)."""

    def __init__(self, dataset: Any, kept_from: int, read_ahead_bytes: int = READ_AHEAD_BYTES):
        self.blocks = EpochBlocks(kept_from=kept_from)
        self._stream = iter(dataset.iter_internal_ref_bundles())
        self._budget = read_ahead_bytes
        self._wanted = 0  # the highest row a rank asked for: read to it, whatever the budget
        self._error: Exception | None = None
        self._closed = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="elastic_train-read-ahead", daemon=True).start()

    def reach(self, row: int) -> None:
        """Wait until the order has `row` rows or ends; raises what the execution raised."""
        with self._changed:
            self._wanted = max(self._wanted, row)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.blocks.rows >= row or self.blocks.ended or self._error is not None)
            if self.blocks.rows < row and self._error is not None:
                raise self._error

    def pieces(self, begin: int, end: int) -> list[Piece]:
        with self._changed:
            return self.blocks.pieces(begin, end)

    def release(self, below: int) -> None:
        with self._changed:
            self.blocks.release(below)
            self._changed.notify_all()

    def close(self) -> None:
        """No more is asked of it: the thread stops after the block it waits for, if any."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _room(self) -> bool:
        return self.blocks.rows < self._wanted or sum(size for _, _, size in self.blocks.blocks) < self._budget

    def _read(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._closed or self._room())
                    if self._closed:
                        return
                bundle = next(self._stream, None)  # outside the lock: it waits on the execution
                entries = list(_entries(bundle)) if bundle is not None else []
                with self._changed:
                    self.blocks.ended = bundle is None
                    for ref, first, rows, size in entries:
                        self.blocks.add((ref, first, size), rows)
                    self._changed.notify_all()
                if bundle is None:
                    return
        except Exception as exc:  # noqa: BLE001 - raised to the rank that asks for a row not read (`reach`)
            with self._changed:
                self._error = exc
                self._changed.notify_all()


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
                self._drop(epoch)
                raise
            held = execution.pieces(begin, end)  # each held block is (its ref, the first row it gives, its bytes)
            found.append([Piece(p.block[0], p.block[1] + p.offset, p.length) for p in held])
        return found

    def forget(self, epoch: int) -> None:
        """The blocks served for `epoch` were lost (their node, or their owner): execute it anew."""
        if self._drop(epoch):
            logger.warning("dataset %r: blocks of epoch %d were lost; executing the epoch again", self._name, epoch)

    def release(self, epoch: int, below: int) -> None:
        """No rank will ask for rows of an epoch before `epoch`, nor for those below `below` in it."""
        for older in [e for e in self._executions if e < epoch]:
            self._drop(older)
        if epoch in self._executions:
            self._executions[epoch].release(below)

    def _execution(self, epoch: int, lowest: int | None) -> _Execution:
        execution = self._executions.get(epoch)
        if execution is not None and (lowest is None or execution.blocks.serves(lowest)):
            return execution
        if execution is not None:
            logger.warning("dataset %r: rows from %d of epoch %d were let go; executing the epoch again",
                           self._name, lowest, epoch)
        for stale in [e for e in self._executions if e >= epoch]:  # this one, or the ranks went back an epoch
            self._drop(stale)
        run_at(self._dataset, epoch)
        execution = self._executions[epoch] = _Execution(self._dataset, lowest or 0)
        for older in sorted(self._executions)[:-EPOCHS_HELD]:
            self._drop(older)
        return execution

    def _drop(self, epoch: int) -> bool:
        """Let go of `epoch`'s execution, if held (its read-ahead stops)."""
        execution = self._executions.pop(epoch, None)
        if execution is not None:
            execution.close()
        return execution is not None


__all__ = ["DatasetCoordinator", "Runs"]
