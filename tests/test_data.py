"""prepare_data_loader: disjoint shards, and no sample skipped or repeated across a resize."""

from __future__ import annotations

import pytest

from elastic_train.torch.data import ElasticBatchSampler
from tests.helpers import make_trainer
from tests.loops import read_progress, sample_counting_loop


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_batch_sampler_shards_are_disjoint_and_cover_the_epoch(world):
    seen = []
    for rank in range(world):
        sampler = ElasticBatchSampler(50, 8, rank, world, shuffle=True, seed=3, drop_last=False)
        sampler.start = 10
        seen += [i for batch in sampler for i in batch]
    order = ElasticBatchSampler(50, 8, 0, 1, shuffle=True, seed=3, drop_last=False).order()
    assert sorted(seen) == sorted(order[10:].tolist())


@pytest.mark.timeout(180)
def test_no_sample_skipped_or_repeated_across_kill_and_regrow(local_ray, run_dirs):
    config = {"samples": 96, "epochs": 6, "global_batch_size": 8, "step_time": 0.15, "fault": {"kind": "kill", "rank": 1, "at_step": 7}}
    result = make_trainer(run_dirs, (1, 2), sample_counting_loop, **config).fit()
    assert result.error is None, result.error
    assert result.metrics == {"step": 72, "epoch": 5}
    final = result.checkpoint.to_dict()["counts"]
    assert final.tolist() == [6.0] * 96, "a sample was skipped or repeated"
    # The run really changed size mid-epoch, and ranks' batches within a step never overlapped.
    assert result.world_sizes[:2] == [2, 1] and result.world_sizes[-1] == 2
    progress = [p for p in read_progress(run_dirs["log_dir"]) if "batch" in p]
    by_step = {}
    for p in progress:
        by_step.setdefault((p["generation"], p["step"]), []).append(p["batch"])
    for batches in by_step.values():
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat))
    assert {len(b) for (g, s), bs in by_step.items() for b in bs if len(bs) == 2} == {4}
    assert {len(b) for (g, s), bs in by_step.items() for b in bs if len(bs) == 1} == {8}


def _loader(rank: int, world: int, per_rank: int = 4, size: int = 40):
    """A prepared loader as prepare_data_loader builds it, without a run (batch `per_rank` per worker)."""
    from torch.utils.data import DataLoader

    from elastic_train.torch.data import ElasticDataLoader

    sampler = ElasticBatchSampler(size, per_rank * world, rank, world, shuffle=True, seed=5, drop_last=False)
    return ElasticDataLoader(DataLoader(list(range(size)), batch_sampler=sampler), sampler, False, per_rank)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lost", [0, 1])
@pytest.mark.parametrize("draws", [1, 3])  # 3: gradient accumulation, the step reduced after three batches
def test_a_loader_going_on_in_place_owes_the_lost_ranks_unreduced_shares_and_uses_every_sample_once(lost, draws):
    loaders = [_loader(rank, 2, size=96) for rank in range(2)]
    epochs = [iter(loader) for loader in loaders]
    used = []
    for step in range(2 * draws):  # two reduced steps at world size 2
        used += [i for epoch in epochs for i in next(epoch).tolist()]
        if (step + 1) % draws == 0:
            for loader in loaders:
                loader.trained()
    drawn = [next(epoch).tolist() for epoch in epochs for _ in range(draws)]  # a step whose reduction fails
    survivor = 1 - lost
    kept = [i for n, batch in enumerate(drawn) if n // draws == survivor for i in batch]
    loaders[survivor].reformed(0, 1, (survivor,))
    state = loaders[survivor].loader_state()
    assert state["owed"] == [i for n, batch in enumerate(drawn) if n // draws == lost for i in batch]
    rest = [i for batch in epochs[survivor] for i in batch.tolist()]
    assert sorted(used + kept + rest) == list(range(96)), "a sample was skipped or used twice in the epoch"
    assert rest[:len(state["owed"])] == state["owed"], "the lost shares come first"
    resumed = _loader(0, 1, size=96)  # a loop entered afresh from that state walks the same rest
    resumed.resume_from(state)
    assert [i for batch in resumed for i in batch.tolist()] == rest
    assert loaders[survivor].loader_state() == {"epoch": 1, "position": 0}


@pytest.mark.timeout(10)
def test_the_samples_owed_are_those_only_the_lost_ranks_held():
    from elastic_train.ingest.cursor import share, untrained

    def shares(chunk: list[int], world: int) -> list[list[int]]:
        return [share(chunk, rank, world) for rank in range(world)]

    assert untrained([shares([1, 2, 3, 4, 5], 2)], (0,)) == [4, 5]
    assert untrained([shares([1, 2, 3, 4, 5], 3), shares([6, 7, 8], 3)], (1,)) == [1, 2, 5, 6, 8]
    assert untrained([shares([9], 2)], (0,)) == []  # with fewer samples than ranks, the survivor held it too


@pytest.mark.timeout(10)
def test_a_second_peer_lost_in_the_same_step_owes_its_share_too():
    """Rank 2 of 3 is lost as the step's batch is drawn (DDP's broadcast of buffers at its forward);
    rank 0 then in its gradient reduction: the survivor, rank 1 (then rank 0 of 2, then of 1), owes the
    epoch both lost shares, and uses every sample once."""
    loaders = [_loader(rank, 3, size=48) for rank in range(3)]
    epochs = [iter(loader) for loader in loaders]
    drawn = [next(epoch).tolist() for epoch in epochs]
    loaders[1].reformed(1, 2, (0, 1))  # rank 2 lost: ranks 0 and 1 keep theirs
    loaders[1].reformed(0, 1, (1,))  # then rank 0 (old 0) lost: old rank 1 alone, rank 0 now
    assert loaders[1].loader_state()["owed"] == drawn[0] + drawn[2]  # the last lost first
    rest = [i for batch in epochs[1] for i in batch.tolist()]
    assert sorted(drawn[1] + rest) == list(range(48)), "a sample was skipped or used twice in the epoch"
