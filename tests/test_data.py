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
    assert sorted(seen) == sorted(order[10:])


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
