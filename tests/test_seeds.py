"""The seeds' Ray Train examples run unchanged but for imports."""

from __future__ import annotations

import os

import pytest

from tests import seed_examples


@pytest.mark.timeout(120)
def test_seed_000_simple_model_on_two_workers(local_ray, run_dirs):
    result = seed_examples.seed_000(run_dirs["storage"])
    assert result.error is None
    assert result.world_sizes == [2]


@pytest.mark.timeout(120)
def test_seed_001_report_and_result_metrics(local_ray, run_dirs):
    result = seed_examples.seed_001(run_dirs["storage"])
    assert result.error is None
    assert set(result.metrics) == {"loss", "epoch"} and result.metrics["epoch"] == 9
    df = result.metrics_dataframe
    assert list(df["epoch"]) == list(range(10))


@pytest.mark.timeout(120)
def test_seed_002_device_model_loader_and_best_checkpoints(local_ray, run_dirs):
    val_losses = [0.9, 0.5, 0.7, 0.3, 0.8, 0.4]
    result = seed_examples.seed_002(run_dirs["storage"], run_dirs["log_dir"], val_losses)
    assert result.error is None, result.error
    # prepare_data_loader gave the two workers disjoint shards that together cover the dataset.
    for epoch in range(len(val_losses)):
        shards = [
            open(os.path.join(run_dirs["log_dir"], f"seen_{epoch}_{rank}")).read().split(",") for rank in (0, 1)
        ]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(map(int, shards[0] + shards[1])) == list(range(64))
    # num_to_keep=3 by lowest val_loss, plus the newest (the one a restore resumes from).
    kept = sorted(m["val_loss"] for _, m in result.best_checkpoints)
    assert kept == [0.3, 0.4, 0.5]
    assert result.checkpoint.to_dict()["epoch"] == 5
    assert sorted(os.listdir(os.path.join(result.path))) == [
        "checkpoint_000002_g0000", "checkpoint_000004_g0000", "checkpoint_000006_g0000",
        "events.jsonl",  # the supervisor's event log (run_folder/event_log.py)
        "metrics.json", "run.json", "trainer.pkl",  # the run record (run_folder/record.py)
    ]
