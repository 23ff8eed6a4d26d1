"""Ray Data ingest's decisions, without Ray: the epoch cursor through random resizes and re-entries,
the coordinator's block index, and a rank's cut of a global batch."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from elastic_train.ingest.blocks import EpochBlocks, Piece
from elastic_train.ingest.cursor import Cursor, StepPlan, plan_step, share_bounds
from elastic_train.ingest.shard import _cut


@pytest.mark.timeout(10)
def test_the_block_index_serves_rows_across_blocks_and_lets_go_of_those_released():
    blocks = EpochBlocks()
    for name, length in [("a", 5), ("b", 0), ("c", 3), ("d", 4)]:
        blocks.add(name, length)
    assert blocks.rows == 12
    assert blocks.pieces(3, 9) == [Piece("a", 3, 2), Piece("c", 0, 3), Piece("d", 0, 1)]
    assert blocks.pieces(10, 20) == [Piece("d", 2, 2)]  # cut at the rows the execution gave so far
    blocks.release(6)
    assert blocks.blocks == ["c", "d"] and blocks.serves(6) and not blocks.serves(5)
    assert blocks.pieces(6, 8) == [Piece("c", 1, 2)]
    with pytest.raises(ValueError, match="released"):
        blocks.pieces(4, 8)
    again = EpochBlocks(kept_from=6)  # an execution again, for rows from 6 on: the blocks below are not held
    for name, length in [("a", 5), ("c", 3), ("d", 4)]:
        again.add(name, length)
    assert again.blocks == ["c", "d"] and again.pieces(6, 12) == blocks.pieces(6, 12)


@pytest.mark.timeout(10)
def test_a_step_plan_asks_for_owed_rows_in_order_then_the_fresh_ones():
    plan = StepPlan(epoch=1, owed=(7, 8, 9, 2, 3), position=20, fresh=3, rank=0, world_size=2)
    assert plan.runs() == [(7, 10), (2, 4), (20, 23)]
    assert plan.chunk(2) == [7, 8, 9, 2, 3, 20, 21] and plan.size(2) == 22 and plan.size(3) is None
    cursor = Cursor()
    cursor.resume_from({"epoch": 0, "position": 30, "owed": [1, 2, 3], "size": 32})
    assert plan_step(cursor, 8, 1, 2) == StepPlan(0, (1, 2, 3), 30, 2, 1, 2)  # not past the known end


@pytest.mark.timeout(10)
def test_a_rank_cuts_its_share_out_of_the_global_batchs_pieces():
    pieces = [Piece("a", 3, 2), Piece("c", 0, 3), Piece("d", 5, 4)]  # rows 0-1, 2-4, 5-8 of the batch
    assert _cut(pieces, 0, 9) == pieces
    assert _cut(pieces, 1, 6) == [Piece("a", 4, 1), Piece("c", 0, 3), Piece("d", 5, 1)]
    assert _cut(pieces, 7, 9) == [Piece("d", 7, 2)]
    assert [share_bounds(9, r, 4) for r in range(4)] == [(0, 3), (3, 5), (5, 7), (7, 9)]  # within one row
    assert [share_bounds(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (1, 2)]  # fewer rows than ranks


class _Run:
    """Ranks walking epochs of a `rows`-row order as the shard does, each step's rows trained by the
    ranks that hold them once the step completes; committed at each report (every rank alike)."""

    def __init__(self, rows: int, per_rank: int, world: int):
        self.rows, self.per_rank = rows, per_rank
        self.cursors = [Cursor() for _ in range(world)]
        self.trained: Counter = Counter()  # (epoch, row) trained by a completed step since the start
        self.report: tuple[dict, Counter] = ({"epoch": 0, "position": 0}, Counter())
        self.walking = False

    def draw(self) -> list[list[int]] | None:
        """Every rank draws the step's batch; the shares by rank, or None as the epoch ends."""
        if not self.walking:
            for cursor in self.cursors:
                cursor.enter()
            self.walking = True
        world = len(self.cursors)
        plans = [plan_step(c, self.per_rank * world, r, world) for r, c in enumerate(self.cursors)]
        found = max(min(plans[0].fresh, self.rows - plans[0].position), 0)
        chunks = [p.chunk(found) for p in plans]
        assert all(c == chunks[0] for c in chunks), "the ranks disagree on the global batch"
        if not chunks[0]:
            for cursor in self.cursors:
                cursor.end()
            self.walking = False
            return None
        for cursor in self.cursors:
            cursor.draw(chunks[0], world)
            cursor.size = plans[0].size(found) if plans[0].size(found) is not None else cursor.size
        return [chunks[0][slice(*share_bounds(len(chunks[0]), r, world))] for r in range(world)]

    def complete(self, shares: list[list[int]]) -> None:
        epoch = self.cursors[0].epoch
        self.trained.update((epoch, row) for row in {row for held in shares for row in held})
        for cursor in self.cursors:
            cursor.trained()

    def lose(self, lost: set[int], shares: list[list[int]]) -> list[list[int]]:
        """Ranks `lost` die in the step: the others go on in place; returns the survivors' shares."""
        survivors = tuple(r for r in range(len(self.cursors)) if r not in lost)
        self.cursors = [self.cursors[r] for r in survivors]
        for rank, cursor in enumerate(self.cursors):
            cursor.reformed(survivors)
        return [shares[r] for r in survivors]

    def make_report(self) -> None:
        states = [c.state() for c in self.cursors]
        assert all(s == states[0] for s in states)
        self.report = (states[0], Counter(self.trained))

    def reenter(self, world: int) -> None:
        """Every rank enters the loop afresh at `world` ranks from the last report."""
        state, trained = self.report
        self.cursors = [Cursor() for _ in range(world)]
        for cursor in self.cursors:
            cursor.resume_from(state)
        self.trained, self.walking = Counter(trained), False

    def grow(self, world: int) -> None:
        """Newcomers join at a report: they start from it, the others go on in place."""
        self.make_report()
        old = len(self.cursors)
        for rank, cursor in enumerate(self.cursors):
            cursor.reformed(tuple(range(old)))
        for _ in range(world - old):
            cursor = Cursor()
            cursor.resume_from(self.report[0])
            cursor.started = self.walking  # it enters the loop where the others walk
            self.cursors.append(cursor)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(40))
def test_random_losses_growths_and_reentries_train_every_row_once_an_epoch(seed):
    rng = random.Random(seed)
    rows, epochs = rng.randint(30, 90), 3
    run = _Run(rows, per_rank=rng.randint(1, 5), world=rng.randint(1, 4))
    events = Counter()
    while run.cursors[0].epoch < epochs:
        shares = run.draw()
        if shares is None:
            continue
        event = rng.random()
        if event < 0.15 and len(run.cursors) > 1:  # peers lost in the step: the rest go on in place
            for _ in range(rng.randint(1, 2)):
                if len(run.cursors) > 1:
                    shares = run.lose(set(rng.sample(range(len(run.cursors)), rng.randint(1, len(run.cursors) - 1))),
                                      shares)
            events["lost"] += 1
        elif event < 0.22:  # the whole group lost in the step: entered afresh from the last report
            run.reenter(rng.choice([1, 2, 3, max(1, len(run.cursors) - 1), len(run.cursors) + 1]))
            events["reentered"] += 1
            continue
        run.complete(shares)
        if rng.random() < 0.5:
            run.make_report()
        if rng.random() < 0.1:
            run.grow(len(run.cursors) + rng.randint(1, 2))
            events["grew"] += 1
    run.make_report()
    by_epoch = Counter(epoch for epoch, _ in run.trained.elements())
    assert dict(by_epoch) == {e: rows for e in range(epochs)} | ({epochs: by_epoch[epochs]} if epochs in by_epoch else {})
    for epoch in range(epochs):
        assert all(run.trained[(epoch, row)] == 1 for row in range(rows)), \
            f"epoch {epoch}: a row trained twice or skipped after {dict(events)}"


@pytest.mark.timeout(60)
def test_dataset_arguments_that_cannot_run_fail_before_any_actor_starts():
    import ray.data
    from ray.train import DataConfig as RayDataConfig

    import elastic_train as et

    def loop():
        pass

    ds = ray.data.from_items([{"id": 1}])

    class Splitting(et.DataConfig):
        def configure(self, *args, **kwargs):
            return []

    with pytest.raises(et.ConfigError, match=r"overrides DataConfig.configure\(\)"):
        et.TorchTrainer(loop, datasets={"train": ds}, dataset_config=Splitting())
    with pytest.raises(et.ConfigError, match=r"datasets_to_split=\['valid'\]\) names no dataset: the trainer has \['train'\]"):
        et.TorchTrainer(loop, datasets={"train": ds}, dataset_config=et.DataConfig(datasets_to_split=["valid"]))
    with pytest.raises(et.ConfigError, match="dataset_config must be an elastic_train.DataConfig"):
        et.TorchTrainer(loop, datasets={"train": ds}, dataset_config={"datasets_to_split": "all"})
    with pytest.raises(et.ConfigError, match="datasets must map names"):
        et.TorchTrainer(loop, datasets=[ds])
    trainer = et.TorchTrainer(loop, datasets={"train": ds, "valid": lambda: ds},
                              dataset_config=RayDataConfig(datasets_to_split=["train"]))  # Ray's own config too
    assert set(trainer.datasets) == {"train", "valid"} and et.TRAIN_DATASET_KEY == "train"


@pytest.mark.timeout(10)
def test_a_shard_refuses_to_materialize_with_what_to_do_instead():
    from elastic_train.ingest.shard import ElasticDataIterator

    shard = ElasticDataIterator("train", None, None, 0, 2)
    with pytest.raises(NotImplementedError, match=r"materialize the dataset before passing it to the trainer"):
        shard.materialize()
