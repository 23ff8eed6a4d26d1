"""`prepare_data_loader`: shards a DataLoader across the current generation's ranks, resumably.

Each step consumes the next `global batch` of one epoch-wide order (seeded, the same on every
rank), split contiguously across ranks. The position in that order is reported with every
`report()`, so after a resize the epoch goes on from the same global sample: within an epoch no
sample is skipped or seen twice, at any world size. With `global_batch_size`, the step's batch is
split across however many workers there are, so the optimisation does not depend on world size.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from elastic_train.faithful.reads import record
from elastic_train.ingest.cursor import Cursor, share
from elastic_train.worker.group.devices import get_device
from elastic_train.worker.loop.current import get_session

logger = logging.getLogger(__name__)


class ElasticBatchSampler:
    """Yields this rank's indices for each step of an epoch: the samples owed to it first, then its
    order from a global position on."""

    def __init__(self, size: int, global_batch: int, rank: int, world_size: int, shuffle: bool, seed: int,
                 drop_last: bool):
        self.size, self.global_batch, self.rank, self.world_size = size, global_batch, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start = 0, 0
        self.owed: list[int] = []  # samples a lost rank drew but did not train, before `start`
        self.asked_epoch: int | None = None  # set_epoch's, for the next epoch entered from its start
        self._permutation: tuple[tuple[int, int, int], torch.Tensor] | None = None  # (seed, epoch, size), its order

    def order(self) -> range | torch.Tensor:
        """The epoch's order: `range(size)`, or the seeded permutation `DistributedSampler` walks, made
        once an epoch. Never a list of the epoch's indices: a loop entered (each recovery re-enters it)
        would pay for one per epoch, 0.3 s at a million samples, on the path back to training."""
        if not self.shuffle:
            return range(self.size)
        key = (self.seed, self.epoch, self.size)
        if self._permutation is None or self._permutation[0] != key:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._permutation = key, torch.randperm(self.size, generator=generator)
        return self._permutation[1]

    def steps_left(self) -> int:
        """The global batches of the rest of the epoch (what `chunks` yields)."""
        return self._batches(len(self.owed) + self.size - self.start)

    def _batches(self, samples: int) -> int:
        full, rest = divmod(samples, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def chunks(self) -> Iterator[list[int]]:
        """The global batches of the rest of the epoch: the owed samples, then the order from `start`."""
        owed, order, start, size = list(self.owed), self.order(), self.start, self.global_batch
        total = len(owed) + self.size - start
        for step in range(self._batches(total)):
            begin, end = step * size, min((step + 1) * size, total)
            head = owed[begin:end] if begin < len(owed) else []
            tail = order[start + max(begin - len(owed), 0) : start + max(end - len(owed), 0)]
            yield head + (tail.tolist() if isinstance(tail, torch.Tensor) else list(tail))

    def __iter__(self) -> Iterator[list[int]]:
        for chunk in self.chunks():
            yield share(chunk, self.rank, self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """As `DistributedSampler.set_epoch` (Ray Train's guides call `loader.sampler.set_epoch(epoch)`
        each epoch): the next epoch entered from its start walks epoch `epoch`'s order. Without it,
        the loader counts its epochs itself (where a `DistributedSampler` would repeat epoch 0's)."""
        self.asked_epoch = epoch

    def __len__(self) -> int:
        return self._batches(self.size)


class ElasticDataLoader:
    """Iterates like the user's DataLoader; one `iter()` is one epoch. Tracks its global position,
    and re-shards the rest of the epoch when the loop goes on in place in a new group."""

    def __init__(self, loader: DataLoader, sampler: ElasticBatchSampler, move_to_device: bool,
                 per_rank_batch: int | None):
        self._loader = loader
        self.batch_sampler = sampler
        self.dataset = loader.dataset
        self._move = move_to_device
        self._per_rank_batch = per_rank_batch  # None: the global batch is fixed (`global_batch_size`)
        self._cursor = Cursor()
        self._reshard = False
        self._epoch_steps: int | None = None  # this epoch's steps, where going on in place changed them

    @property
    def sampler(self) -> ElasticBatchSampler:
        """The sampler, where Ray Train's guides find it (`loader.sampler.set_epoch(epoch)`)."""
        return self.batch_sampler

    @property
    def epoch(self) -> int:
        """The epoch being walked; before the first `iter()`, the one a resumed loader goes on in."""
        return self._cursor.epoch

    def resume_from(self, state: dict[str, Any] | None, mid_epoch: bool = True) -> None:
        """Go on from a report's loader `state`. Without `mid_epoch` (prepare_data_loader's default),
        a state in mid-epoch starts that epoch afresh, as the new loader of Ray Train's re-run does:
        a loop that fast-forwards itself (`if epoch == start and i < skip: continue`) then skips what it
        trained once, not twice."""
        if state and not mid_epoch:
            state = {"epoch": state["epoch"], "position": 0}
        self._cursor.resume_from(state)

    def loader_state(self) -> dict[str, Any]:
        return self._cursor.state()

    def reported(self, carries_state: bool) -> None:
        """Nothing to let go: the dataset is the loop's own."""

    def trained(self) -> None:
        """Every rank trained the batches drawn so far: the step's gradients were reduced, or a report
        was made (a loop draws a batch for its step, not ahead of the step's backward)."""
        self._cursor.trained()

    def reformed(self, rank: int, world_size: int, previous_ranks: tuple[int, ...]) -> None:
        """Go on as `rank` of `world_size` (`previous_ranks`: each new rank's previous one): the samples
        only the lost ranks drew since the last `trained` come first in the rest of the epoch."""
        self._cursor.reformed(previous_ranks)
        self.batch_sampler.rank, self.batch_sampler.world_size = rank, world_size
        if self._per_rank_batch is not None:
            self.batch_sampler.global_batch = self._per_rank_batch * world_size
        self._reshard = True

    def __len__(self) -> int:
        """The epoch's steps: at this world size, or, in an epoch the loop went on in place in, those it
        walks (the steps drawn, then the rest re-sharded, the lost ranks' shares first). A count the
        loop may hold (faithful/reads.py): going on in place mid-epoch would change it under it."""
        steps = self._epoch_steps if self._epoch_steps is not None else len(self.batch_sampler)
        record("epoch_steps", steps, sys._getframe(1))
        return steps

    def __iter__(self) -> Iterator[Any]:
        cursor = self._cursor
        cursor.enter()
        asked = self.batch_sampler.asked_epoch
        if asked is not None and cursor.position == 0 and not cursor.owed:  # set_epoch, as DistributedSampler's
            cursor.epoch, self.batch_sampler.asked_epoch = asked, None
        device = get_device()
        resharded, walked = True, 0
        self._epoch_steps = None
        while resharded:  # once, and again from where it stands each time the loop went on in a new group
            sampler = self.batch_sampler
            sampler.epoch, sampler.start, sampler.owed = cursor.epoch, cursor.position, list(cursor.owed)
            self._reshard = resharded = False
            if walked:
                self._epoch_steps = walked + sampler.steps_left()
            for chunk, batch in zip(sampler.chunks(), self._loader):
                cursor.draw(chunk, sampler.world_size)
                walked += 1
                yield _to_device(batch, device) if self._move else batch
                if self._reshard:
                    resharded = True
                    break
        self._epoch_steps = None
        cursor.end()


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def sampling_of(data_loader: DataLoader, seed: int, warn: bool = True) -> tuple[bool, int, bool]:
    """The `(shuffle, seed, drop_last)` of the elastic sampler that stands for `data_loader`'s sampler.

    Ray Train's rule (ray/train/torch/train_loop_utils.py, `_TorchAccelerator.prepare_data_loader`):
    a user's `DistributedSampler` is kept as it is, so its `shuffle`, `seed` and `drop_last` carry
    over (its seed wins over `seed`); any other sampler gives way to `DistributedSampler(shuffle=not
    isinstance(sampler, SequentialSampler))`, seeded `seed`, over the whole dataset. A sampler that is
    not a permutation of the dataset (`WeightedRandomSampler`, `SubsetRandomSampler`, a custom one)
    is thus replaced by a shuffle of every index: `warn` logs that, as Ray does. `drop_last` is also
    the loader's own: the elastic sampler drops the epoch's last incomplete global batch.
    """
    sampler = data_loader.sampler
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle), int(sampler.seed), bool(sampler.drop_last or data_loader.drop_last)
    shuffle = not isinstance(sampler, SequentialSampler)
    permutes = isinstance(sampler, SequentialSampler) or (
        isinstance(sampler, RandomSampler) and not sampler.replacement
        and sampler.num_samples == len(data_loader.dataset))  # what DataLoader(shuffle=True) builds
    if warn and not permutes:
        logger.warning(
            "prepare_data_loader: the DataLoader's %s is replaced by a shuffled, resumable sampler over all "
            "%d samples of the dataset (seed %d, a new order each epoch), as Ray Train replaces it by "
            "DistributedSampler(shuffle=True): its weights, subset or draws with replacement are not kept. "
            "Pass add_dist_sampler=False to keep the loader as it is (unsharded, and not resumed mid-epoch).",
            type(sampler).__name__, len(data_loader.dataset), seed)
    return shuffle, seed, bool(data_loader.drop_last)


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
    global_batch_size: int | None = None,
    seed: int = 0,
    resume_mid_epoch: bool = False,
) -> ElasticDataLoader | DataLoader:
    """Shard `data_loader` across the current ranks and move its batches to `get_device()`.

    `global_batch_size` fixes the samples per step across all workers (split among them); by
    default each worker keeps the loader's own batch size. Shuffling follows the loader's sampler as in
    Ray Train (`sampling_of`): any sampler but a `SequentialSampler` shuffles; a `DistributedSampler`
    the user built keeps its `shuffle`, `drop_last` and `seed`, which wins over `seed` here; a sampler
    that is not a permutation (`WeightedRandomSampler`, `SubsetRandomSampler`) is replaced by a shuffle
    of the whole dataset, with a warning.

    A loop re-entered from a report made mid-epoch starts that epoch afresh, as Ray Train's re-run does
    (its loader is new there). `resume_mid_epoch=True` (ours) goes on from the report's position
    instead, every sample of the epoch trained once: for a loop that does not fast-forward itself.
    So does a loop resumed from its state kept live (`prepare_model(live_state=True)`): its loaders'
    positions are all it has. A loop that goes on in place always goes on mid-epoch: it never left it.
    """
    del auto_transfer  # batches are moved synchronously; kept for Ray Train's signature
    if not add_dist_sampler:
        return data_loader
    session = get_session("prepare_data_loader")
    ctx = session.context
    if data_loader.batch_size is None:
        raise ValueError("prepare_data_loader needs a DataLoader built with batch_size (not a custom batch_sampler).")
    world = ctx.get_world_size()
    global_batch = global_batch_size or data_loader.batch_size * world
    if global_batch < 1:
        raise ValueError(f"prepare_data_loader(global_batch_size={global_batch_size!r}) must be at least 1.")
    shuffle, seed, drop_last = sampling_of(data_loader, seed, warn=ctx.get_world_rank() == 0)
    sampler = ElasticBatchSampler(
        size=len(data_loader.dataset),
        global_batch=global_batch,
        rank=ctx.get_world_rank(),
        world_size=world,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    inner = DataLoader(
        data_loader.dataset,
        batch_sampler=sampler,
        num_workers=data_loader.num_workers,
        collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory,
        worker_init_fn=data_loader.worker_init_fn,
        persistent_workers=data_loader.persistent_workers,
    )
    wrapped = ElasticDataLoader(inner, sampler, move_to_device, None if global_batch_size else data_loader.batch_size)
    wrapped.resume_from(session.register_loader(wrapped), mid_epoch=resume_mid_epoch or session.resumes_kept_state)
    return wrapped


__all__ = ["prepare_data_loader", "sampling_of", "ElasticBatchSampler", "ElasticDataLoader"]
