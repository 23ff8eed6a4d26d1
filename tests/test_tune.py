"""Ray Tune over elastic_train, on real Ray: the seed's `tune.Tuner(TorchTrainer(...))` with ASHA,
Ray Train V2's function trainable with `TuneReportCallback`, and a trial whose process is SIGKILLed
mid-run, restarted by Tune, that resumes from its run's checkpoint.

A trial of the ASHA test runs 2 workers of 1 CPU and a driver (the trial's process) of 1 CPU: 6 CPUs
hold two trials at once, as `max_concurrent_trials=2` asks (elastic_train/tune.py on sizing). The
other tests run 1 worker a trial: the whole file takes ~1.5 to 2.5 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import elastic_train as train
from elastic_train import Checkpoint, RunConfig, ScalingConfig
from elastic_train.callbacks import UserCallback
from elastic_train.checkpoint.manifest import MANIFEST
from elastic_train.torch import TorchTrainer
from elastic_train.tune import CHECKPOINT_PATH_KEY, TuneReportCallback, trainer_for_trial
from tests.conftest import ray_runtime_env, stop_ray
from tests.helpers import wait_for

LRS = [1e-1, 1e-2, 1e-3, 1e-4]  # best first: later trials fall below ASHA's cutoff at their first rung


@pytest.fixture(scope="module")
def ray_for_tune():
    stop_ray()
    ray.init(num_cpus=6, runtime_env=ray_runtime_env(), include_dashboard=False)
    yield
    ray.shutdown()


def train_func(config: dict) -> None:
    """Ray Train's loop shape: resume from the checkpoint, report a loss every step with a checkpoint.
    The loss falls faster with a larger lr, so ASHA ranks the trials by lr."""
    start = 0
    if (checkpoint := train.get_checkpoint()) is not None:
        start = checkpoint.to_dict()["step"] + 1
    for step in range(start, config["steps"]):
        time.sleep(config["step_s"])  # the step's work
        loss = 1.0 / (1.0 + 100 * config["lr"] * (step + 1))
        train.report({"loss": loss, "step": step}, checkpoint=Checkpoint.from_dict({"step": step}))


def no_actor_alive() -> None:
    """Wait until every actor of the cluster is dead: trials, supervisors, workers. (Ray's state API,
    `ray.util.state.list_actors`, needs the dashboard of ray[default]; the GCS table is read directly.)"""
    wait_for(lambda: all(a["State"] == "DEAD" for a in ray._private.state.actors().values()), 30,
             "every actor to be dead after tuner.fit()")


def committed(checkpoint_path: str) -> bool:
    return (Path(checkpoint_path) / MANIFEST).is_file()


def assert_clean(run_folder: Path) -> dict:
    """The run ended cleanly (no torn checkpoint folder: each has its manifest); returns its run.json."""
    folders = sorted(run_folder.glob("checkpoint_*"))
    assert folders and all(committed(str(f)) for f in folders), [f.name for f in folders if not committed(str(f))]
    return json.loads((run_folder / "run.json").read_text())


def test_trial_config_goes_over_the_trainer_arguments(tmp_path):
    """As Ray's Tuner merges a trial's config into a trainer's: a key naming a TorchTrainer argument
    updates it (dicts key by key, configs field by field), any other key goes into train_loop_config."""
    loop_config = {"steps": 4, "optimizer": {"lr": 1.0, "momentum": 0.9}}
    trainer = TorchTrainer(train_func, train_loop_config=loop_config, scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="sweep", storage_path=str(tmp_path)))
    callback = UserCallback()
    trial = trainer_for_trial(trainer, {"lr": 0.1, "optimizer": {"lr": 0.5}, "train_loop_config": {"steps": 6},
                                        "scaling_config": {"num_workers": (1, 3)}}, "abc12_00001", callback)
    assert trial.train_loop_config == {"steps": 6, "optimizer": {"lr": 0.5, "momentum": 0.9}, "lr": 0.1}
    assert trial.scaling_config == ScalingConfig(num_workers=(1, 3))
    assert trial.run_config.name == "sweep_abc12_00001" and trial.run_config.storage_path == str(tmp_path)
    assert trial.run_config.callbacks == [callback]
    assert trainer.train_loop_config == loop_config and trainer.run_config.callbacks is None


@pytest.mark.timeout(150)
def test_tuner_over_torch_trainer_with_asha(ray_for_tune, tmp_path):
    """The seed's Workflow 3: top-level keys of param_space go into train_loop_config; ASHA stops the
    trials that fall behind, and each stopped run ends cleanly (newest checkpoint committed)."""
    steps = 6
    tuner = tune.Tuner(
        TorchTrainer(
            train_func,
            train_loop_config={"steps": steps, "step_s": 0.25},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=str(tmp_path / "runs")),
        ),
        param_space={"lr": tune.grid_search(LRS), "batch_size": tune.choice([16, 32, 64, 128])},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(metric="loss", mode="min", grace_period=1, reduction_factor=2),
            max_concurrent_trials=2,
        ),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="asha", verbose=0),
    )
    results = tuner.fit()

    assert not results.errors
    best = results.get_best_result(metric="loss", mode="min")
    assert best.config["lr"] == LRS[0] and best.config["batch_size"] in (16, 32, 64, 128)
    assert best.metrics["step"] == steps - 1 and committed(best.metrics[CHECKPOINT_PATH_KEY])
    stopped = 0
    for result in results:
        trial_id = result.metrics["trial_id"]
        run = assert_clean(tmp_path / "runs" / f"TorchTrainer_{trial_id}")
        assert run["state"].lower() == "finished" and run["config"]["train_loop_config"]["lr"] == result.config["lr"]
        if result.metrics["training_iteration"] < steps:  # ASHA stopped it
            assert run["stopped"] == f"Tune stopped trial {trial_id}", run
            stopped += 1
    assert stopped >= 2, "ASHA stopped no trial mid-run"
    no_actor_alive()


def train_driver_fn(config: dict) -> None:
    """Ray Train V2's Tune pattern (its guide's code, imports changed): a TorchTrainer per trial."""
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config["train_loop_config"],
        scaling_config=ScalingConfig(num_workers=1),
        run_config=RunConfig(
            name=f"train-trial_id={tune.get_context().get_trial_id()}",
            storage_path=config["storage_path"],
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


@pytest.mark.timeout(120)
def test_function_trainable_with_tune_report_callback(ray_for_tune, tmp_path):
    """Ray Train V2's pattern: each report reaches Tune with the committed checkpoint's folder."""
    steps = 3
    tuner = tune.Tuner(
        train_driver_fn,
        param_space={
            "train_loop_config": {"lr": tune.grid_search(LRS[:2]), "steps": steps, "step_s": 0.0},
            "storage_path": str(tmp_path / "runs"),
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=2),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="v2", verbose=0),
    )
    results = tuner.fit()

    assert not results.errors
    best = results.get_best_result(metric="loss", mode="min")
    assert best.config["train_loop_config"]["lr"] == LRS[0]
    assert best.metrics["step"] == steps - 1 and best.metrics["training_iteration"] == steps
    assert committed(best.metrics[CHECKPOINT_PATH_KEY])
    for result in results:
        assert_clean(tmp_path / "runs" / f"train-trial_id={result.metrics['trial_id']}")
    no_actor_alive()


class KillOnce(tune.Callback):
    """SIGKILLs the trial's process once it has reported a committed checkpoint; keeps every result."""

    def __init__(self) -> None:
        self.results: list[dict] = []
        self.killed: dict | None = None

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        self.results.append(result)
        if self.killed is None and CHECKPOINT_PATH_KEY in result:
            self.killed = result
            os.kill(result["pid"], signal.SIGKILL)


@pytest.mark.timeout(150)
def test_trial_killed_and_restarted_resumes_from_its_checkpoint(ray_for_tune, tmp_path):
    """The trial's process (the run's driver, owner of its supervisor) is SIGKILLed; Tune restarts the
    trial, whose run (named after the trial) goes on from its newest committed checkpoint."""
    steps = 8
    killer = KillOnce()
    tuner = tune.Tuner(
        TorchTrainer(
            train_func,
            train_loop_config={"steps": steps, "step_s": 0.3},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(storage_path=str(tmp_path / "runs")),
        ),
        param_space={"lr": 1e-2},
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="restart", verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=1), callbacks=[killer]),
    )
    results = tuner.fit()

    assert not results.errors and killer.killed is not None
    restarted = [r for r in killer.results if r["pid"] != killer.killed["pid"]]
    assert restarted, "Tune did not restart the trial"
    # The restarted trial's run resumed from its newest committed checkpoint: past the killed one's step.
    assert restarted[0]["step"] > killer.killed["step"], [r["step"] for r in killer.results]
    assert restarted[-1]["step"] == steps - 1
    assert results[0].metrics["step"] == steps - 1
    assert_clean(tmp_path / "runs" / f"TorchTrainer_{killer.killed['trial_id']}")
    no_actor_alive()
