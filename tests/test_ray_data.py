"""Ray Data in, exactly once (`TorchTrainer(datasets=...)`, `get_dataset_shard`): loops as Ray Train's
guides write them, fed by Ray Data, their workers (and the datasets' coordinator) killed mid-epoch."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

import elastic_train as et

from tests.data_loops import dataset_counting_loop
from tests.guide_loops import ray_dataset
from tests.helpers import make_trainer
from tests.loops import read_progress
from tests.test_in_place import check_run


def _ids(rows: int, shuffled: bool = False):
    """Row ids 0..rows-1 in their "id" column, through a map_batches; `shuffled`: by an unseeded
    random_shuffle (a new order each epoch)."""
    import ray.data

    dataset = ray.data.range(rows, override_num_blocks=7)
    return (dataset.random_shuffle() if shuffled else dataset).map_batches(lambda b: {"id": b["id"]})


def _steps_disjoint(log_dir: str) -> None:
    """Within a step, no two ranks trained the same row."""
    by_step: dict = {}
    for p in read_progress(log_dir):
        if "batch" in p:
            by_step.setdefault((p["generation"], p["step"]), []).extend(p["batch"])
    assert by_step and all(len(rows) == len(set(rows)) for rows in by_step.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_guide_loop_on_ray_data_goes_on_in_place_when_a_worker_is_killed_mid_epoch(data_ray, run_dirs, killed):
    """tests/guide_loops.py with `data="ray"`: DDP through prepare_model, rank 0 saves once an epoch.
    Rank 1 is SIGKILLed in epoch 1's fourth step: the survivor goes on in place with the lost rank's
    rows first, the replacement joins once ready; every row once an epoch, and the weights of a
    fault-free run through the same steps. Rank 0 killed: the survivor read its rank in that step and
    is renumbered, so its loop is re-entered from memory (as Ray Train's), with the same checks."""
    config = {"epochs": 6, "step_time": 0.1, "data": "ray", "fault": {"kind": "kill", "rank": killed, "at_step": 103}}
    result = make_trainer(run_dirs, (1, 2), __import__("tests.guide_loops").guide_loops.guide_loop,
                          datasets={"train": ray_dataset()}, **config).fit()
    check_run(result, run_dirs["log_dir"], config, ["in place", "memory"] if killed else ["memory"],
              reentered=killed == 0)


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


@pytest.mark.timeout(120)
def test_the_coordinator_reads_an_epoch_ahead_of_the_ranks_up_to_its_budget(data_ray):
    """Ray Data's executor loops without pause while its output waits to be taken: the coordinator
    takes an epoch's blocks as they come, so an epoch that fits its budget is read to its end after
    the first ask (and its executor stops); one that does not is held no further than the budget
    ahead, and a rank's ask reads past it. Either way, every row of the epoch is served, in the order
    the execution gave it."""
    from elastic_train.ingest.coordinator import _Execution
    from tests.helpers import wait_for

    def served(execution, rows):
        execution.reach(rows)
        return [row for p in execution.pieces(0, rows) for row in
                ray.get(p.block[0])["id"].to_pylist()[p.block[1] + p.offset:p.block[1] + p.offset + p.length]]

    whole = _Execution(_ids(64), 0)
    first = served(whole, 8)
    wait_for(lambda: whole.blocks.ended or None, 60, "the epoch read to its end without being asked")
    every = served(whole, 64)
    assert whole.blocks.rows == 64 and every[:8] == first and sorted(every) == list(range(64))
    whole.close()

    budget = _Execution(_ids(64), 0, read_ahead_bytes=1)  # every block is over it: one read past the ask
    first = served(budget, 8)
    time.sleep(0.5)  # time to read further, were it not held to its budget
    assert not budget.blocks.ended and budget.blocks.rows < 64, budget.blocks.rows
    every = served(budget, 64)
    assert every[:8] == first and sorted(every) == list(range(64))
    budget.close()


@pytest.mark.timeout(240)
def test_a_coordinator_killed_mid_epoch_is_rebuilt_and_serves_on_from_the_ranks_cursor(data_ray, run_dirs):
    """The dataset's coordinator is SIGKILLed once the run is a few steps into its second epoch: Ray
    restarts it, it executes the epoch again in the same order (the dataset's unseeded random_shuffle
    too), and the ranks go on where they stood."""
    from elastic_train.driver.launch import coordinator_name
    from elastic_train.supervisor.adoption import ACTOR_NAMESPACE
    from tests.helpers import fit_in_background

    config = {"rows": 96, "epochs": 3, "batch_size": 4, "step_time": 0.1}
    join = fit_in_background(make_trainer(run_dirs, 2, dataset_counting_loop,
                                          datasets={"train": _ids(96, shuffled=True)}, **config))
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


@pytest.mark.timeout(240)
def test_the_torch_trainer_docstring_example_runs_as_ported(data_ray, run_dirs):
    import math

    from tests.data_examples import docstring_trainer

    result = docstring_trainer(et.RunConfig(storage_path=run_dirs["storage"], name="run")).fit()
    assert result.error is None, result.error
    assert math.isfinite(result.metrics["loss"]) and result.checkpoint is not None


@pytest.mark.timeout(300)
def test_the_regression_example_goes_on_when_a_worker_is_killed_mid_epoch(data_ray, run_dirs, tmp_path):
    """torch_regression_example.py as ported (CSV read, map_batches in pandas, train_test_split, only
    "train" split, rank 0 validating on the whole "validation" set): a worker is SIGKILLed in the
    second epoch, between its two reports; the run ends with its three epochs' reports."""
    from tests.data_examples import regression_trainer, write_regression_csv
    from tests.helpers import fit_in_background, wait_for

    csv = str(tmp_path / "regression.csv")
    write_regression_csv(csv, 1200)
    join = fit_in_background(regression_trainer(csv, et.RunConfig(storage_path=run_dirs["storage"], name="run")))
    run = wait_for(lambda: _attached("run"), 120, "the run's supervisor")
    status = wait_for(lambda: (lambda s: s if s["index"] >= 1 and len(s["members"]) == 2 else None)(run.status()),
                      120, "the first epoch's report")
    victim = next(m for m in run.members() if m.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    assert run.status()["index"] == status["index"] == 1, "the kill was not in the second epoch"
    result = join(240)
    assert result.error is None, result.error
    assert len(result.metrics_history) == 3 and 1 in result.world_sizes
    assert "loss" in result.metrics


def data_context_loop(config):
    """Ray Train's test_data_context_propagation: what the loop reads of its DataContext."""
    from ray.data import DataContext

    from tests.loops import log_progress

    rows = sum(len(batch["id"]) for batch in et.get_dataset_shard("train").iter_batches())
    log_progress(config["log_dir"], foo=DataContext.get_current().get_config("foo", None), rows=rows)


@pytest.mark.timeout(120)
def test_a_setting_on_the_drivers_data_context_reaches_every_workers_loop(data_ray, run_dirs):
    """As in Ray Train: the DataContext the driver holds as it makes the trainer is each worker's."""
    from ray.data import DataContext

    driver = DataContext.get_current()
    saved = driver.get_config("foo", None)
    driver.set_config("foo", "bar")
    try:
        trainer = make_trainer(run_dirs, 2, data_context_loop, datasets={"train": _ids(8)})
    finally:
        driver.set_config("foo", saved)
    trainer.fit()
    assert [(p["foo"], p["rows"]) for p in read_progress(run_dirs["log_dir"])] == [("bar", 4), ("bar", 4)]


def _attached(name: str):
    from chaos.targets import RunHandle

    try:
        return RunHandle(name)
    except ValueError:
        return None


FUZZ_CHANGES = 100  # membership changes: kills (N -> N-1, or -> 1) and the replacements' joins (N -> N+1)
FUZZ_EPOCHS = 400


@pytest.mark.timeout(900)
def test_a_hundred_random_kills_and_resizes_train_every_row_once_and_end_as_a_fault_free_run(data_ray, run_dirs):
    """tests/guide_loops.py on Ray Data at 1 to 3 workers: from outside, SIGKILL a random worker, or all
    but one, at a random point of a step, each time the run trains again at two or more, until its
    membership changed FUZZ_CHANGES times (each kill, and each replacement's join, opens a generation).
    Every row once an epoch among the completed steps, and the weights of a fault-free run through the
    same world-size schedule. A process redoes steps only where its loop was entered afresh from a
    report: a second peer lost in the step the loop went on in place in, or one lost before the loop's
    first reduction (docs/in_place.md); the steps it redoes are the lineage's."""
    import contextlib
    import random
    import time

    from tests.guide_loops import guide_loop
    from tests.helpers import fit_in_background, surfacing_the_runs_error, wait_for

    config = {"epochs": FUZZ_EPOCHS, "step_time": 0.05, "data": "ray", "lr": 0.01}
    join = fit_in_background(make_trainer(run_dirs, (1, 3), guide_loop, datasets={"train": ray_dataset()},
                                          elastic=et.ElasticConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0),
                                          **config))
    with surfacing_the_runs_error(join):
        run = wait_for(lambda: _attached("run"), 120, "the run's supervisor")
        rng, kills, started = random.Random(36), [], time.monotonic()
        while run.status()["generation"] < FUZZ_CHANGES:
            generation = run.status()["generation"]
            members = wait_for(lambda: (lambda m: m if len(m) >= 2 else None)(run.members()), 120, "two workers training")
            time.sleep(rng.uniform(0.0, 0.3))  # a random point of a step
            victims = members[1:] if rng.random() < 0.15 else [rng.choice(members)]
            for victim in victims:
                with contextlib.suppress(ProcessLookupError):  # lost already, since members() answered
                    os.kill(victim.pid, signal.SIGKILL)
            kills.append((len(members), len(members) - len(victims)))
            wait_for(lambda: run.status()["generation"] > generation, 120, "the run to re-form")
        config["epochs"] = run.status()["metrics"]["epoch"] + 3  # end the run soon, every rank alike
        print(f"{len(kills)} kills, {run.status()['generation']} generations in {time.monotonic() - started:.0f} s, "
              f"{config['epochs']} epochs")
        with open(os.path.join(run_dirs["log_dir"], "epochs.tmp"), "w") as f:
            f.write(str(config["epochs"]))
        os.rename(os.path.join(run_dirs["log_dir"], "epochs.tmp"), os.path.join(run_dirs["log_dir"], "epochs"))
    result = join(600)
    check_run(result, run_dirs["log_dir"], config, None, reentered=True)
    assert {after for _, after in kills} >= {1, 2}, kills
