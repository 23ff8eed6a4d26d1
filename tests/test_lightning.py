"""elastic_train.lightning: Ray's Lightning names run the seed's pattern on real Ray; a Lightning run
that loses a worker or a node mid-epoch goes on in place, mid-epoch, at the new size, with no sample
skipped or repeated, and ends where a fault-free run ends."""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import elastic_train as et
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.lightning_loops import QUIET, SAMPLES, lightning_classes, reference_state, seed_as_written, seed_loop
from tests.loops import read_progress

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


@functools.cache
def reference(epochs: int, global_batch: int) -> dict[str, torch.Tensor]:
    """The fault-free trajectory, computed once per shape in this process (see `reference_state`)."""
    return reference_state(epochs, global_batch)


def assert_same_parameters(checkpoint: et.Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    with checkpoint.as_directory() as d:
        state = torch.load(Path(d, "checkpoint.ckpt"), weights_only=True)["state_dict"]
    assert state.keys() == expected.keys()
    for name, value in expected.items():  # DDP sums in another order than one process: rounding only
        assert torch.allclose(state[name], value, rtol=1e-4, atol=1e-5), (name, (state[name] - value).abs().max())


@pytest.mark.timeout(120)
def test_the_seed_exactly_as_written_trains_in_the_runs_working_directory(local_ray, run_dirs):
    """Lightning's own checkpointing and logger write relative to the working directory: as under
    Ray Train, that is the run's own (not the directory the driver was started in)."""
    result = et.TorchTrainer(seed_as_written, train_loop_config={"epochs": 2, "batch_size": 4,
                                                                 "notes": run_dirs["log_dir"]},
                             scaling_config=et.ScalingConfig(num_workers=2),
                             run_config=et.RunConfig(storage_path=run_dirs["storage"], name="seed-lightning")).fit()
    notes = read_progress(run_dirs["log_dir"])
    assert sorted((n["rank"], n["world"], n["step"]) for n in notes) == [(0, 2, 24), (1, 2, 24)]
    (working_dir,) = {n["cwd"] for n in notes}
    try:
        assert working_dir != os.getcwd() and Path(working_dir).name.startswith("seed-lightning_")
        saved = list(Path(working_dir, "lightning_logs").glob("version_*/checkpoints/*.ckpt"))
        assert [p.name for p in saved] == ["epoch=1-step=24.ckpt"], saved
    finally:
        shutil.rmtree(working_dir, ignore_errors=True)
    assert result.metrics == {} and result.checkpoint is None and result.world_sizes == [2]  # it reports nothing


@pytest.mark.timeout(60)
def test_classes_follow_the_lightning_package_of_the_calling_code():
    """Both packages are imported here: each call site gets the classes of the package it uses."""
    from elastic_train import lightning as et_lightning

    for package in PACKAGES:
        pl = importlib.import_module(package)
        strategy = et_lightning.RayDDPStrategy(global_batch_size=8)
        callback = et_lightning.RayTrainReportCallback(every_n_train_steps=3)
        environment = et_lightning.RayLightningEnvironment()
        assert isinstance(strategy, pl.strategies.DDPStrategy) and isinstance(strategy, et_lightning.RayDDPStrategy)
        assert isinstance(callback, pl.callbacks.Callback) and isinstance(callback, et_lightning.RayTrainReportCallback)
        assert isinstance(environment, pl.plugins.environments.LightningEnvironment)
        assert environment.creates_processes_externally
        assert type(strategy).__name__ == "RayDDPStrategy" and strategy.global_batch_size == 8
        del pl
    fsdp = et_lightning.RayFSDPStrategy()  # built, as Ray's own tests build one beside RayDDPStrategy
    assert isinstance(fsdp, tuple(importlib.import_module(p).strategies.FSDPStrategy for p in PACKAGES))
    with pytest.raises(et.ConfigError, match="RayFSDPStrategy is not supported: .*non-CPU accelerator"):
        fsdp.setup_environment()  # what a Trainer calls first as it sets the strategy up
    from elastic_train.lightning import RayDeepSpeedStrategy  # imported beside the others, as Ray's tests do

    with pytest.raises(et.ConfigError, match="RayDeepSpeedStrategy is not supported: .*partitioned by world size"):
        RayDeepSpeedStrategy(stage=3)
    for removed in ("LightningTrainer", "LightningConfigBuilder", "LightningCheckpoint", "LightningPredictor"):
        with pytest.raises(et.UnsupportedAPIError, match="Ray removed it"):
            getattr(et_lightning, removed)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("package", PACKAGES)
def test_seed_pattern_on_two_workers_and_its_checkpoint_resumes_outside_ray(local_ray, run_dirs, package):
    epochs = 2
    result = make_trainer(run_dirs, 2, seed_loop, lightning=package, epochs=epochs, batch_size=4).fit()
    assert result.error is None, result.error
    steps = epochs * SAMPLES // 8  # 4 per worker, as in Ray: 8 per step on 2 workers
    assert result.metrics["epoch"] == epochs - 1 and result.metrics["step"] == steps
    assert {"loss", "val_loss"} <= result.metrics.keys()
    # A fault-free run on 2 workers is the in-process reference the fault tests compare with.
    assert_same_parameters(result.checkpoint, reference(epochs, 8))

    pl = importlib.import_module(package)
    module_class, data_class = lightning_classes(package)
    config = {"batch_size": 4}
    trainer = pl.Trainer(max_epochs=epochs + 1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, default_root_dir=run_dirs["log_dir"], **QUIET)
    with result.checkpoint.as_directory() as d:
        trainer.fit(module_class(config), datamodule=data_class(config), ckpt_path=os.path.join(d, "checkpoint.ckpt"))
    assert trainer.current_epoch == epochs + 1 and trainer.global_step == steps + SAMPLES // 4


def check_recovered_run(run_dirs: dict, result: et.Result, epochs: int, every: int, victims: set[int]) -> list[dict]:
    """What every fault test asserts; returns the steps' records (one per rank and step)."""
    assert result.error is None, result.error
    assert result.metrics["epoch"] == epochs - 1, "the run did not finish every epoch"
    records = [p for p in read_progress(run_dirs["log_dir"]) if "ids" in p]
    kept_generation: dict[int, int] = {}  # a step's samples are those of the last generation that ran it
    for p in records:
        kept_generation[p["step"]] = max(kept_generation.get(p["step"], -1), p["generation"])
    kept = [p for p in records if p["generation"] == kept_generation[p["step"]]]
    for epoch in range(epochs):
        seen = sorted(i for p in kept if p["epoch"] == epoch for i in p["ids"])
        assert seen == list(range(SAMPLES)), f"epoch {epoch}: a sample was skipped or repeated"
    redone = {p["step"] for p in records if p["generation"] < kept_generation[p["step"]]}
    assert len(redone) <= every, f"steps redone {sorted(redone)} exceed the report interval {every}"
    # The survivors kept their processes: every process of the first generation but the victims' ran the last.
    first, last = min(p["generation"] for p in records), max(p["generation"] for p in records)
    survivors = {p["pid"] for p in records if p["generation"] == first} - victims
    assert survivors and survivors <= {p["pid"] for p in records if p["generation"] == last}
    # The loop went on at a smaller world from the freshest checkpoint, held in memory.
    resumed = [e for e in result.events if e["kind"] == "generation" and e.get("resume_from")]
    assert resumed and resumed[0]["resume_from"] == "memory" and resumed[0]["world_size"] == 1
    return records


@pytest.mark.timeout(120)
@pytest.mark.parametrize("global_batch", [8, None], ids=["global_batch", "per_worker_batch"])
def test_sigkill_mid_epoch_recovers_in_place_and_mid_epoch(local_ray, run_dirs, global_batch):
    """Rank 1 SIGKILLs itself at step 17, the 5th step of epoch 1 (12 steps of 8 samples per epoch at 2
    workers). With a constant global batch the run ends with a fault-free run's parameters; with
    Ray's per-worker batch the survivor walks the rest of the epoch in steps of 4, none skipped."""
    epochs, every = 3, 2
    strategy = {"global_batch_size": global_batch} if global_batch else {}
    result = make_trainer(run_dirs, (1, 2), seed_loop, lightning="lightning.pytorch", epochs=epochs, batch_size=4,
                          strategy=strategy, report={"every_n_train_steps": every}, step_time=0.05,
                          fault={"kind": "kill", "rank": 1, "at_step": 17},
                          elastic=et.ElasticConfig(warm_spares_per_node=0)).fit()  # no spare: the survivor goes on
    fault = json.loads(Path(run_dirs["log_dir"], "fault.json").read_text())
    records = check_recovered_run(run_dirs, result, epochs, every, victims={fault["pid"]})
    assert result.world_sizes[:2] == [2, 1]
    # It went on from the step after the last report (16), inside epoch 1, not from the epoch's start.
    after = [p for p in records if p["generation"] > 0]
    assert min(p["step"] for p in after) == 17 and {p["epoch"] for p in after if p["step"] == 17} == {1}
    if global_batch:
        assert result.metrics["step"] == epochs * SAMPLES // global_batch
        assert_same_parameters(result.checkpoint, reference(epochs, global_batch))
    resumed = min(p["time"] for p in records if p["generation"] > 0)
    print("kill -> first step of the next generation: %.3f s" % (resumed - fault["time"]),
          "world sizes:", result.world_sizes)


@pytest.mark.timeout(240)
def test_node_removed_then_added_mid_epoch(three_node_cluster, run_dirs):
    """Two 1-CPU nodes: the run loses the node of rank 1 mid-epoch, goes on alone, and grows back to 2
    once a node is added."""
    cluster, nodes = three_node_cluster
    cluster.remove_node(nodes[2])  # no spare capacity: growing back needs the node added below
    epochs, every = 16, 2
    join = fit_in_background(make_trainer(
        run_dirs, (1, 2), seed_loop, lightning="lightning.pytorch", epochs=epochs, batch_size=4,
        strategy={"global_batch_size": 8}, report={"every_n_train_steps": every}, step_time=0.1))

    def records(world: int, after: float = 0.0) -> list[dict]:
        return [p for p in read_progress(run_dirs["log_dir"]) if p.get("world") == world and p["time"] > after]

    first = wait_for(lambda: [p for p in records(2) if p["step"] >= 3], 120, "2 workers training")
    victim = next(p for p in first if p["rank"] == 1)
    removed_at = time.time()
    cluster.remove_node(next(n for n in nodes if n.node_id == victim["node"]))
    wait_for(lambda: records(1, removed_at), 60, "the run to go on at 1 worker")
    added_at = time.time()
    cluster.add_node(num_cpus=1)
    wait_for(lambda: records(2, added_at), 120, "the run to grow back to 2 workers")
    result = join(120)
    check_recovered_run(run_dirs, result, epochs, every, victims={victim["pid"]})
    assert result.world_sizes[:2] == [2, 1] and result.world_sizes[-1] == 2
    assert result.metrics["step"] == epochs * SAMPLES // 8
    assert_same_parameters(result.checkpoint, reference(epochs, 8))
