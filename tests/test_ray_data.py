"""Ray Data in, exactly once (`TorchTrainer(datasets=...)`, `get_dataset_shard`): loops as Ray Train's
guides write them, fed by Ray Data, their workers (and the datasets' coordinator) killed mid-epoch."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from tests.data_loops import dataset_counting_loop
from tests.guide_loops import ray_dataset
from tests.helpers import make_trainer
from tests.loops import read_progress
from tests.test_in_place import check_run


def _ids(rows: int):
    import ray.data

    return ray.data.range(rows, override_num_blocks=7).map_batches(lambda b: {"id": b["id"]})


def _steps_disjoint(log_dir: str) -> None:
    """Within a step, no two ranks trained the same row."""
    by_step: dict = {}
    for p in read_progress(log_dir):
        if "batch" in p:
            by_step.setdefault((p["generation"], p["step"]), []).extend(p["batch"])
    assert by_step and all(len(rows) == len(set(rows)) for rows in by_step.values())


@pytest.mark.timeout(240)
def test_a_guide_loop_on_ray_data_goes_on_in_place_when_a_worker_is_killed_mid_epoch(data_ray, run_dirs):
    """tests/guide_loops.py with `data="ray"`: DDP through prepare_model, rank 0 saves once an epoch.
    Rank 0 is SIGKILLed in epoch 1's fourth step: the survivor goes on in place with the lost rank's
    rows first, the replacement joins at the epoch's checkpoint; every row once an epoch, and the
    weights of a fault-free run through the same steps."""
    config = {"epochs": 6, "step_time": 0.1, "data": "ray", "fault": {"kind": "kill", "rank": 0, "at_step": 103}}
    result = make_trainer(run_dirs, (1, 2), __import__("tests.guide_loops").guide_loops.guide_loop,
                          datasets={"train": ray_dataset()}, **config).fit()
    check_run(result, run_dirs["log_dir"], config, ["in place", "memory"])


@pytest.mark.timeout(240)
def test_a_loop_reentered_from_its_checkpoint_trains_every_row_once_an_epoch(data_ray, run_dirs):
    """tests/data_loops.py: each step's row counts all-reduced by hand and checkpointed by every rank.
    Rank 1 is SIGKILLed at step 7 (of 12 an epoch): the run re-forms without it and later with a
    replacement, the epoch going on from the reported cursor; every count is the number of epochs."""
    config = {"rows": 96, "epochs": 3, "batch_size": 4, "step_time": 0.05,
              "fault": {"kind": "kill", "rank": 1, "at_step": 7}}
    result = make_trainer(run_dirs, (1, 2), dataset_counting_loop, datasets={"train": _ids(96)}, **config).fit()
    assert result.error is None, result.error
    assert result.checkpoint.to_dict()["counts"].tolist() == [3.0] * 96, "a row was skipped or trained twice"
    assert result.world_sizes[:2] == [2, 1]
    _steps_disjoint(run_dirs["log_dir"])


@pytest.mark.timeout(240)
def test_a_coordinator_killed_mid_epoch_is_rebuilt_and_serves_on_from_the_ranks_cursor(data_ray, run_dirs):
    """The dataset's coordinator is SIGKILLed once the run is a few steps into its second epoch: Ray
    restarts it, it executes the epoch again in the same order, and the ranks go on where they stood."""
    from elastic_train.driver.launch import coordinator_name
    from elastic_train.supervisor.adoption import ACTOR_NAMESPACE
    from tests.helpers import fit_in_background

    config = {"rows": 96, "epochs": 3, "batch_size": 4, "step_time": 0.1}
    join = fit_in_background(make_trainer(run_dirs, 2, dataset_counting_loop, datasets={"train": _ids(96)},
                                          **config))
    import time

    deadline = time.monotonic() + 120
    while not any(p.get("step", 0) >= 16 for p in read_progress(run_dirs["log_dir"])):
        assert time.monotonic() < deadline, "the run did not reach its second epoch"
        time.sleep(0.1)
    coordinator = ray.get_actor(coordinator_name("run", "train"), namespace=ACTOR_NAMESPACE)
    pid = ray.get(coordinator.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    assert ray.get(coordinator.__ray_call__.remote(lambda self: os.getpid()), timeout=60) != pid, "not restarted"
    result = join(180)
    assert result.error is None, result.error
    assert result.checkpoint.to_dict()["counts"].tolist() == [3.0] * 96, "a row was skipped or trained twice"
    assert result.world_sizes == [2]
