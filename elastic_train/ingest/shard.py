"""`get_dataset_shard(name)`: this rank's share of a Ray Data dataset, as Ray's `DataIterator`.

Each `iter_batches` / `iter_torch_batches` walk is one epoch. Step k's batch is this rank's share of
global batch k (per-rank `batch_size` times the world size), for the rank and world size of the
moment: its rows come from the dataset's coordinator (coordinator.py) by their place in the epoch's
order, and the epoch's place is this rank's cursor (cursor.py), reported with every `report()`.
After a resize the rest of the epoch is split over the new world, the lost ranks' untrained rows
first: no row of an epoch is trained twice or skipped. The next step's rows are fetched while the
loop trains the current one.

Where we differ from Ray: shares are equal within one row (no `equal=True` truncation: where an
epoch's last global batch has fewer rows than there are ranks, a rank without one takes its last
row again, so that every rank takes the step); `iter_rows` draws one row a step; a local
shuffle (`local_shuffle_buffer_size`) permutes the rows within each batch, seeded by
`local_shuffle_seed`, the epoch and the batch's place (a redone step gets the same batch);
`batch_size=None` (whole blocks) takes 256 rows a rank; `materialize()` of a shard is refused (it
would fix this rank's rows for a world size that changes).
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import ray
from ray.data.block import BlockAccessor, _apply_batch_format
from ray.data.iterator import DataIterator

from elastic_train.ingest.blocks import Piece
from elastic_train.ingest.cursor import Cursor, StepPlan, plan_step, share_bounds

logger = logging.getLogger(__name__)

WHOLE_BLOCKS_ROWS = 256  # a rank's rows a step for batch_size=None (Ray: one block)
FETCH_ATTEMPTS = 3  # a restarted coordinator's blocks are new objects: ask again for those lost with the old


@dataclass
class Drawn:
    """One step's batch: the global batch's rows and this rank's, formatted."""

    chunk: list[int]
    batch: Any
    size: int | None  # rows in the epoch's order, where this batch reached its end


class _Iterable:
    """An iterable whose every `iter()` is a new epoch's walk (as Ray's iterables are)."""

    def __init__(self, walk: Callable[[], Iterator[Any]]):
        self._walk = walk

    def __iter__(self) -> Iterator[Any]:
        return self._walk()


class ElasticDataIterator(DataIterator):
    """This rank's share of one dataset, served by its coordinator; a loader the session drives."""

    def __init__(self, name: str, coordinator: Any, dataset: Any, rank: int, world_size: int):
        self._name, self._coordinator, self._dataset = name, coordinator, dataset
        self._rank, self._world_size = rank, world_size
        self._cursor = Cursor()
        self._resumable: list[tuple[int, int]] = []  # the lowest rows of the two newest states a resume may start from
        self._fetcher: ThreadPoolExecutor | None = None
        self._ahead: tuple[StepPlan, Future[Drawn | None]] | None = None

    # -- as the session drives a loader (worker/loop/session.py StatefulLoader) -------------------------
    def resume_from(self, state: dict[str, Any] | None) -> None:
        self._cursor.resume_from(state)
        self._resumable = [self._cursor.lowest_row()]  # the generation's own start, until two newer ones

    def loader_state(self) -> dict[str, Any]:
        return {**self._cursor.state(), "dataset": self._name}

    def reported(self, carries_state: bool) -> None:
        """Where the report carries state, a resume may start from it: rank 0 tells the coordinator which
        rows none will ask for again (below the older of the two newest such states). Rows let go are
        executed again if asked for (a run restored from an older checkpoint): slower, as exact."""
        if not carries_state:
            return
        self._resumable = [*self._resumable[-1:], self._cursor.lowest_row()]
        if self._rank == 0:
            self._coordinator.release.remote(*min(self._resumable))

    def trained(self) -> None:
        self._cursor.trained()

    def reformed(self, rank: int, world_size: int, previous_ranks: tuple[int, ...]) -> None:
        self._cursor.reformed(previous_ranks)
        self._rank, self._world_size = rank, world_size
        self._ahead = None

    # -- Ray's DataIterator ------------------------------------------------------------------------
    def iter_rows(self) -> Any:
        """Ray's, one row a step: a rank draws no row before it hands it over."""
        batches = self._iter_batches(batch_size=1, batch_format=None)

        def rows() -> Iterator[Any]:
            for batch in batches:
                yield from BlockAccessor.for_block(BlockAccessor.batch_to_block(batch)).iter_rows(
                    public_row_format=True)

        return _Iterable(rows)

    def iter_torch_batches(self, **kwargs: Any) -> Any:
        """Ray's, with `device="auto"` this worker's device (`elastic_train.torch.get_device()`)."""
        if kwargs.get("device", "auto") == "auto":
            from elastic_train.worker.group.devices import get_device

            kwargs["device"] = get_device()
        return super().iter_torch_batches(**kwargs)

    def _iter_batches(self, *, prefetch_batches: int = 1, batch_size: int | None = 256,
                      batch_format: str | None = "default", drop_last: bool = False,
                      local_shuffle_buffer_size: int | None = None, local_shuffle_seed: int | None = None,
                      _collate_fn: Callable[[Any], Any] | None = None,
                      _finalize_fn: Callable[[Any], Any] | None = None) -> _Iterable:
        """One batch a step: this rank's share of the global batch (see the module's docstring)."""
        del prefetch_batches  # the next step's batch is always fetched ahead, one step
        per_rank = batch_size or WHOLE_BLOCKS_ROWS
        form = _Form(_apply_batch_format(batch_format), local_shuffle_buffer_size is not None,
                     local_shuffle_seed, _collate_fn, _finalize_fn)
        return _Iterable(lambda: self._walk(per_rank, drop_last, form))

    def _walk(self, per_rank: int, drop_last: bool, form: _Form) -> Iterator[Any]:
        cursor = self._cursor
        cursor.enter()
        self._ahead = None
        while True:
            plan = self._plan(per_rank)
            drawn = self._take(plan, form)
            if drawn is None or (drop_last and len(drawn.chunk) < per_rank * plan.world_size):
                break
            cursor.draw(drawn.chunk, plan.world_size)
            cursor.size = drawn.size if drawn.size is not None else cursor.size
            after = self._plan(per_rank)
            self._ahead = (after, self._fetch_pool().submit(self._fetch, after, form))
            yield _Form.handed(drawn.batch)
        cursor.end()

    def _plan(self, per_rank: int) -> StepPlan:
        return plan_step(self._cursor, per_rank * self._world_size, self._rank, self._world_size)

    def _take(self, plan: StepPlan, form: _Form) -> Drawn | None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == plan:
            return ahead[1].result()
        return self._fetch(plan, form)

    def _fetch_pool(self) -> ThreadPoolExecutor:
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"elastic_train-data-{self._name}")
        return self._fetcher

    def _fetch(self, plan: StepPlan, form: _Form) -> Drawn | None:
        """The step's global batch and this rank's batch of it; None where the epoch is walked."""
        if not plan.owed and not plan.fresh:
            return None
        for attempt in range(FETCH_ATTEMPTS):
            runs = ray.get(self._coordinator.pieces.remote(plan.epoch, plan.runs()))
            fresh = sum(p.length for p in runs[-1])
            chunk = plan.chunk(fresh)
            if not chunk:
                return None
            begin, end = share_bounds(len(chunk), plan.rank, plan.world_size)
            try:
                block = _block_of(_cut([p for run in runs for p in run], begin, end))
            except ray.exceptions.ObjectLostError:  # their node, or their owner (a coordinator restarted since)
                if attempt + 1 == FETCH_ATTEMPTS:
                    raise
                logger.warning("dataset %r: blocks of epoch %d lost; asking for them again", self._name, plan.epoch)
                ray.get(self._coordinator.forget.remote(plan.epoch))
                continue
            return Drawn(chunk, form(block, (plan.epoch, chunk[begin])), plan.size(fresh))
        raise AssertionError("unreachable")

    def _to_ref_bundle_iterator(self) -> Any:
        raise NotImplementedError(
            f"get_dataset_shard({self._name!r}).materialize() (or to_tf) would fix this rank's rows for a world "
            "size that changes here. Iterate the shard (iter_batches / iter_torch_batches), or materialize the "
            "dataset before passing it to the trainer (datasets={...: ds.materialize()}).")

    def stats(self) -> str:
        return f"elastic_train shard of dataset {self._name!r} (rank {self._rank} of {self._world_size})"

    def schema(self) -> Any:
        return self._dataset.schema()

    def get_context(self) -> Any:
        return self._dataset.context

    def __repr__(self) -> str:
        return f"ElasticDataIterator({self._name!r}, rank={self._rank}, world_size={self._world_size})"


@dataclass(frozen=True)
class _Form:
    """How a step's block becomes the loop's batch (Ray's batch format, collate and finalize)."""

    batch_format: str | None
    shuffle: bool
    seed: int | None
    collate: Callable[[Any], Any] | None
    finalize: Callable[[Any], Any] | None

    def __call__(self, block: Any, where: tuple[int, int]) -> Any:
        if self.shuffle:
            rows = list(range(BlockAccessor.for_block(block).num_rows()))
            random.Random(f"{self.seed}:{where}").shuffle(rows)
            block = BlockAccessor.for_block(block).take(rows)
        batch = BlockAccessor.for_block(block).to_batch_format(self.batch_format)
        if self.collate is not None:
            batch = self.collate(batch)
        return self.finalize(batch) if self.finalize is not None else batch

    @staticmethod
    def handed(batch: Any) -> Any:
        """The batch as the loop gets it: Ray's finalize (a device copy) may wrap it with a callback to
        make as it is handed over (FinalizedData)."""
        if hasattr(batch, "on_consume"):
            if batch.on_consume is not None:
                batch.on_consume()
            return batch.data
        return batch


def _cut(pieces: list[Piece], begin: int, end: int) -> list[Piece]:
    """Rows [begin, end) of the rows `pieces` hold, in order."""
    cut, at = [], 0
    for p in pieces:
        lo, hi = max(begin, at), min(end, at + p.length)
        if lo < hi:
            cut.append(Piece(p.block, p.offset + lo - at, hi - lo))
        at += p.length
    return cut


def _block_of(pieces: list[Piece]) -> Any:
    """One block of the pieces' rows, in order (sliced without copying where one piece holds them)."""
    blocks = ray.get([p.block for p in pieces])
    parts = [BlockAccessor.for_block(b).slice(p.offset, p.offset + p.length, copy=False)
             for b, p in zip(blocks, pieces)]
    if len(parts) == 1:
        return parts[0]
    from ray.data._internal.delegating_block_builder import DelegatingBlockBuilder

    builder = DelegatingBlockBuilder()
    for part in parts:
        builder.add_block(part)
    return builder.build()


__all__ = ["ElasticDataIterator"]
