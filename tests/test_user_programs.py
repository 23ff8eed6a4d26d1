"""Programs written the way Ray Train's user guides write them, with `ray.train` -> `elastic_train`,
one per defect met by users. Each asserts what the user expects: the run finishes, its final
metrics and state equal a fault-free run's (fixed seeds; the fault-free state is computed in this
process), and the steps redone are bounded.

The faults are injected by the loop itself, once per run (a marker file in the log dir, as
tests/loops.py `fault_once` does), so every run meets the same fault at the same step.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastic_train as train
from elastic_train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from elastic_train.torch import TorchTrainer, prepare_model
from chaos.memory import corrupt_held_copy
from tests.conftest import release_ray, start_ray
from tests.helpers import fit_in_background
from tests.loops import log_progress, read_progress
from tests.patterns import AppState, assert_losses, fault_free_losses, step_lines, steps_redone, summary


@pytest.fixture
def ray_4_cpus():
    """A 4-CPU Ray instance on this machine (room for 4 workers), shared by consecutive tests."""
    start_ray(4)
    yield
    release_ray()


# == what the programs share: a fault once, progress lines, the model and its data ================
def once(config: dict, name: str = "fault") -> bool:
    """True the first time any process of the run gets here (a marker file in the log dir)."""
    try:
        fd = os.open(Path(config["log_dir"]) / f"{name}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    ctx = train.get_context()
    os.write(fd, json.dumps({"pid": os.getpid(), "time": time.time(), "rank": ctx.get_world_rank(),
                             "generation": ctx.get_generation()}).encode())
    os.close(fd)
    return True


def progress(config: dict, step: int, **extra) -> None:
    ctx = train.get_context()
    log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                 generation=ctx.get_generation(), step=step, **extra)


def read_marker(log_dir: str, name: str = "fault") -> dict:
    return json.loads((Path(log_dir) / f"{name}.json").read_text())


TRUE_W = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
GLOBAL_BATCH = 8


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: the same whatever the world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x, x @ TRUE_W + 0.5


def my_share(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of the global batch: DDP's average of the ranks' gradients is then the
    full batch's gradient, so the run's math does not depend on the world size (up to rounding)."""
    ctx = train.get_context()
    per = GLOBAL_BATCH // ctx.get_world_size()
    x, y = batch(step)
    r = ctx.get_world_rank()
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def sgd(params) -> torch.optim.Optimizer:
    """The programs' optimizer, unless they say otherwise."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def reference(steps: int, optimizer_of=sgd) -> dict[int, tuple[list[float], float]]:
    """The fault-free run, in this process: the parameters after each step, and the loss rank 0 of
    2 reports at that step (on its half of the batch, before the update)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = optimizer_of(model.parameters())
    out = {}
    for step in range(1, steps + 1):
        x, y = batch(step)
        with torch.no_grad():
            rank_0_loss = torch.nn.functional.mse_loss(model(x[:GLOBAL_BATCH // 2]), y[:GLOBAL_BATCH // 2]).item()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        out[step] = (flat(model), rank_0_loss)
    return out


def assert_params_follow_reference(lines: list[dict], steps: int, timeline: str, optimizer_of=sgd) -> None:
    """Every computed step left the parameters the fault-free run has after that step."""
    expected = reference(steps, optimizer_of)
    wrong = [f"rank {p['rank']} gen {p['generation']} step {p['step']}: {p['params']} != {expected[p['step']][0]}"
             for p in lines if not torch.allclose(torch.tensor(p["params"]), torch.tensor(expected[p["step"]][0]),
                                                  rtol=1e-5, atol=1e-6)]
    assert not wrong, "\n".join(wrong[:8]) + f"\n{timeline}"


def assert_finished(result: train.Result) -> str:
    timeline = summary(result)
    assert result.error is None, f"{str(result.error)[-3000:]}\n--- timeline:\n{timeline}"
    return timeline


# == 1. Same file name on every rank ==============================================================
def same_file_name_loop(config):
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            with open(os.path.join(checkpoint_dir, "step.txt")) as f:
                start = int(f.read())
    rank = train.get_context().get_world_rank()
    for step in range(start + 1, config["steps"] + 1):
        if step == 4 and rank == 1 and once(config):
            os._exit(1)
        time.sleep(config["step_time"])
        progress(config, step)
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            with open(os.path.join(temp_checkpoint_dir, "step.txt"), "w") as f:
                f.write(str(step))
            train.report({"step": step}, checkpoint=Checkpoint.from_directory(temp_checkpoint_dir))


@pytest.mark.timeout(240)
def test_every_rank_writes_the_same_file_name_and_rank_1_exits(ray_4_cpus, run_dirs):
    """4 workers, every rank reports `step.txt` each step (no collective); rank 1's process exits at step 4.

    Steps are short (5 ms), as in a loop of small steps: the other ranks have reported several more
    steps by the time the exit is noticed."""
    steps = 100
    trainer = TorchTrainer(
        same_file_name_loop,
        train_loop_config={"steps": steps, "step_time": 0.005, "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             failure_config=FailureConfig(max_failures=3)),
    )
    result = fit_in_background(trainer)(200)
    timeline = assert_finished(result)
    assert result.metrics["step"] == steps
    with result.checkpoint.as_directory() as d:
        assert Path(d, "step.txt").read_text() == str(steps), f"not the last checkpoint\n{timeline}"
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1))
    fault = read_marker(run_dirs["log_dir"])
    # Rank 1 had reported step 3; the others go on until the exit is noticed (no collective to stop them).
    ahead = {p["step"] for p in lines if p["generation"] == fault["generation"] and p["time"] > fault["time"]}
    assert steps_redone(lines) <= 1 + len(ahead), timeline
    assert set(result.world_sizes) == {4}, timeline


# == FSDP2 sharded by the loop, DCP saved by every rank (Ray Train's FSDP2 guide) ==================
FSDP_BATCH = 12  # split equally over 2 or 3 ranks


def fsdp_blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(4)])


def fsdp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: a function of the step alone."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(FSDP_BATCH, 64, generator=g), torch.randn(FSDP_BATCH, 64, generator=g)


def fsdp2_dcp_loop(config):
    """The loop as Ray Train's FSDP2 guide writes it: each block and the root sharded by the loop over a
    1-D mesh of the world, AdamW, every rank saving its shards with DCP every 5th step."""
    ctx = train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    model = fsdp_blocks()
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = AppState(model, optimizer)
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            dcp.load({"app": state}, checkpoint_id=checkpoint_dir)
    for step in range(state.step + 1, config["steps"] + 1):
        if step == config["kill_at"] and rank == 0 and config.get("corrupt") and once(config, "corrupt"):
            assert corrupt_held_copy(*config["corrupt"]), "rank 0 holds no such copy"
        if step == config["kill_at"] and rank == config["kill_rank"] and once(config):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = fsdp_batch(step)
        per = FSDP_BATCH // world
        loss = torch.nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        state.step = step
        time.sleep(config["step_time"])
        progress(config, step, loss=mean.item() / world)
        if step % 5 == 0:
            with tempfile.TemporaryDirectory() as checkpoint_dir:
                dcp.save({"app": state}, checkpoint_id=checkpoint_dir)
                train.report({"step": step}, checkpoint=Checkpoint.from_directory(checkpoint_dir))
        else:
            train.report({"step": step})


def fit_fsdp2(run_dirs: dict, scaling, **config) -> tuple[train.Result, list[dict], str]:
    """fsdp2_dcp_loop for 20 steps, rank 1 SIGKILLed at step 12; the result, rank 0's lines, the timeline."""
    config = {"log_dir": run_dirs["log_dir"], "steps": 20, "kill_at": 12, "kill_rank": 1, "step_time": 0.05, **config}
    result = TorchTrainer(fsdp2_dcp_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=scaling),
                          run_config=RunConfig(storage_path=run_dirs["storage"], name="run",
                                               failure_config=FailureConfig(max_failures=3))).fit()
    timeline = assert_finished(result)
    assert not [e for e in result.events if e["kind"] == "failure"], timeline
    lines = [p for p in step_lines(read_progress(run_dirs["log_dir"]), result) if p["rank"] == 0]
    assert {p["step"] for p in lines} == set(range(1, config["steps"] + 1)), timeline
    assert_losses(lines, fault_free_losses(fsdp_blocks(), fsdp_batch, config["steps"]), timeline)
    return result, lines, timeline


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scaling", [3, (2, 3)], ids=["fixed", "elastic"])
def test_fsdp2_sharded_by_the_loop_resumes_its_checkpoint_from_memory_on_the_renumbered_ranks(
        ray_4_cpus, run_dirs, scaling):
    """Rank 1 is SIGKILLed at step 12: the survivors (rank 2 renumbered 1) resume checkpoint 10 from
    memory, each loading the new rank's shards; steps 11 and 12 are redone with their losses."""
    result, lines, timeline = fit_fsdp2(run_dirs, scaling)
    resumed = [e for e in result.events if e["kind"] == "generation" and e["generation"] > 0]
    assert resumed and resumed[0]["resume_from"] == "memory" and resumed[0]["resume_index"] == 10, timeline
    assert steps_redone(lines) <= 2, timeline


@pytest.mark.timeout(240)
def test_a_corrupt_copy_in_memory_is_found_where_it_is_served_and_the_run_resumes_from_storage(ray_4_cpus, run_dirs):
    """As rank 1 is SIGKILLed at step 12, one byte of rank 0's own copy of its shard of checkpoint 10
    flips (the only copy left: its replica was rank 1's). The ranks served it find it is not what was
    reported: the event names it, the generation ends, and the next resumes from storage at 10, every
    loss that of the fault-free run."""
    result, lines, timeline = fit_fsdp2(run_dirs, 3, corrupt=(10, "__0_0.distcp"))
    corrupt = [e for e in result.events if e["kind"] == "checkpoint_copy_corrupt"]
    assert corrupt and {(e["index"], e["name"]) for e in corrupt} == {(10, "__0_0.distcp")}, timeline
    assert "does not match its checksum (xxh3_128)" in corrupt[0]["problem"], corrupt
    generations = [e for e in result.events if e["kind"] == "generation" and e["generation"] > 0]
    assert [(e["resume_from"], e["resume_index"]) for e in generations] == [("memory", 10), ("storage", 10)], timeline


# == 2. Preemption notice in a fixed-size run, rank 0 alone saving ================================
def rank_0_saves_loop(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model = prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
    for step in range(start + 1, config["steps"] + 1):
        if step == config["fault_step"] and train.get_context().get_world_rank() == config.get("fault_rank", 1) \
                and once(config):
            # SIGTERM is what a node shutting down sends: a preemption notice.
            os.kill(os.getpid(), getattr(signal, config.get("signal", "SIGKILL")))
        x, y = my_share(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The last step may be long (a final evaluation, say).
        time.sleep(config.get("last_step_time", config["step_time"]) if step == config["steps"] else config["step_time"])
        progress(config, step, params=flat(model))
        metrics = {"loss": loss.item(), "step": step}
        every = config.get("checkpoint_every", 1)
        if train.get_context().get_world_rank() == 0 and (step % every == 0 or step == config["steps"]):
            with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(temp_checkpoint_dir))
        else:
            train.report(metrics)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scaling, safe_wait", [(2, None), ((1, 2), None), (2, 0)],
                         ids=["fixed", "elastic", "fixed-nowait"])
def test_rank_0_checkpoints_every_third_step_and_rank_1_is_killed_between(local_ray, run_dirs, scaling, safe_wait):
    """Ray Train's usual pattern with sparse checkpoints: rank 0 saves a folder every 3rd step, the
    other reports carry metrics (those report() calls leave before their barrier passes, the ones
    with a checkpoint wait: worker/report/barrier.py). Rank 1 is SIGKILLed as step 8 starts: the run goes on
    from step 6's checkpoint in memory, redoes step 7 alone, and every checkpoint is committed. Rank
    1's reports died in its batch: rank 0's say rank 0 alone held a part (`part_ranks`), so step 6's
    checkpoint is whole without them; also where reports are never sent at once (`part_safe_wait_s=0`)."""
    steps, every = 24, 3
    elastic = {} if safe_wait is None else {"elastic_config": train.ElasticConfig(part_safe_wait_s=safe_wait)}
    trainer = TorchTrainer(
        rank_0_saves_loop,
        train_loop_config={"steps": steps, "step_time": 0.05, "fault_step": 8, "checkpoint_every": every,
                           "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=scaling),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"], **elastic),
    )
    result = fit_in_background(trainer)(200)
    timeline = assert_finished(result)
    assert result.metrics["step"] == steps
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1)), timeline
    assert_params_follow_reference(lines, steps, timeline)
    assert steps_redone(lines) <= 1, timeline
    assert read_marker(run_dirs["log_dir"]) and [e for e in result.events if e["kind"] == "worker_lost"], timeline
    stored = []
    for checkpoint, _ in result.best_checkpoints:
        with checkpoint.as_directory() as d:
            stored.append(torch.load(os.path.join(d, "checkpoint.pt"))["step"])
    assert stored == list(range(every, steps + 1, every)), f"checkpoints {stored}\n{timeline}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("notice_rank", [0, 1])
def test_preemption_notice_in_a_fixed_size_run_loses_no_step(local_ray, run_dirs, notice_rank):
    """2 workers, rank 0 alone checkpoints; SIGTERM (a preemption notice) to one rank at step 20."""
    steps = 30
    trainer = TorchTrainer(
        rank_0_saves_loop,
        train_loop_config={"steps": steps, "step_time": 0.05, "fault_step": 20, "fault_rank": notice_rank,
                           "signal": "SIGTERM",
                           "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             failure_config=FailureConfig(max_failures=3)),
    )
    result = fit_in_background(trainer)(200)
    timeline = assert_finished(result)
    expected = reference(steps)
    assert result.metrics["step"] == steps
    assert result.metrics["loss"] == pytest.approx(expected[steps][1], rel=1e-4)
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1))
    assert_params_follow_reference(lines, steps, timeline)
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "checkpoint.pt"))
    assert state["step"] == steps, f"not the last checkpoint\n{timeline}"
    assert torch.allclose(torch.cat([state["model"]["weight"].flatten(), state["model"]["bias"]]),
                          torch.tensor(expected[steps][0]), rtol=1e-5, atol=1e-6)
    assert steps_redone(lines) == 0, timeline
    assert [e for e in result.events if e["kind"] == "preemption_notice"
            and e["pid"] == read_marker(run_dirs["log_dir"])["pid"]], timeline
    assert set(result.world_sizes) == {2}, timeline
    # A notice is no failure: the group re-forms without restarting, and nobody is lost.
    assert not [e for e in result.events if e["kind"] in ("worker_lost", "failure")
                or (e["kind"] == "state" and e["target"] == "RESTARTING")], timeline


# == 3. One bug, hit by every rank, counted once ===================================================
def buggy_first_pass_loop(config):
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_epoch = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start_epoch = state["epoch"] + 1
        log_progress(config["log_dir"], restored_epoch=start_epoch - 1, rank=train.get_context().get_world_rank())
    steps_per_epoch = config["steps_per_epoch"]
    for epoch in range(start_epoch, config["epochs"]):
        if epoch == 1 and checkpoint is None:
            raise RuntimeError("a bug in the code that starts epoch 1 (only on a fresh start)")
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i + 1
            x, y = my_share(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress(config, step, params=flat(model))
        time.sleep(config["step_time"])
        metrics = {"loss": loss.item(), "epoch": epoch}
        if train.get_context().get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(temp_checkpoint_dir))
        else:
            train.report(metrics)


@pytest.mark.timeout(180)
def test_one_bug_raised_by_every_rank_counts_as_one_failure(local_ray, run_dirs):
    """Both ranks raise at the start of epoch 1 (after epoch 0's checkpoint): Ray Train counts one
    failure of the worker group, restarts it, and it finishes from epoch 0's checkpoint."""
    epochs, per = 4, 3
    trainer = TorchTrainer(
        buggy_first_pass_loop,
        train_loop_config={"epochs": epochs, "steps_per_epoch": per, "step_time": 0.1, "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             failure_config=FailureConfig(max_failures=1)),
    )
    result = fit_in_background(trainer)(150)
    timeline = assert_finished(result)
    failures = [e for e in result.events if e["kind"] == "failure"]
    assert len(failures) == 1, timeline
    assert "a bug in the code that starts epoch 1" in failures[0]["detail"]
    assert result.metrics["epoch"] == epochs - 1
    progress_lines = read_progress(run_dirs["log_dir"])
    assert {p["restored_epoch"] for p in progress_lines if "restored_epoch" in p} == {0}
    lines = step_lines(progress_lines, result)
    assert {p["step"] for p in lines} == set(range(1, epochs * per + 1))
    assert_params_follow_reference(lines, epochs * per, timeline)
    assert steps_redone(lines) == 0, timeline
    assert result.metrics["loss"] == pytest.approx(reference(epochs * per)[epochs * per][1], rel=1e-4)


# == 4. Shrinking to one worker with model.module in the checkpoint (rank_0_saves_loop, SIGKILL) ======
@pytest.mark.timeout(180)
def test_shrinking_to_one_worker_keeps_model_module(local_ray, run_dirs):
    """num_workers=(1, 2), `prepare_model` and `model.module.state_dict()` as the guides write them;
    rank 1 is SIGKILLed mid-run, so the run goes on at world size 1 for a while."""
    steps = 30
    trainer = TorchTrainer(
        rank_0_saves_loop,
        train_loop_config={"steps": steps, "step_time": 0.1, "fault_step": 10, "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"]),
    )
    result = fit_in_background(trainer)(150)
    timeline = assert_finished(result)
    assert 1 in result.world_sizes, timeline
    assert result.metrics["step"] == steps
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1))
    assert_params_follow_reference(lines, steps, timeline)
    assert steps_redone(lines) <= 1, timeline
    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "checkpoint.pt"))["step"] == steps, f"not the last checkpoint\n{timeline}"


# == 5. A preemption notice during the last step ===================================================
@pytest.mark.timeout(180)
def test_preemption_notice_during_the_last_step_still_stores_the_last_checkpoint(local_ray, run_dirs):
    """The same program, storing every 4th checkpoint (`store_every_n_reports=4`); rank 1 gets a
    preemption notice (SIGTERM) as the last step (18) begins. The group unwinds after that last
    report and re-forms without rank 1, with nothing left to run: the last checkpoint, which the
    cadence did not store, must still be stored before fit() returns, as it is in a run without the
    notice."""
    steps = 18
    trainer = TorchTrainer(
        rank_0_saves_loop,
        train_loop_config={"steps": steps, "step_time": 0.1, "fault_step": steps, "signal": "SIGTERM",
                           "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             checkpoint_config=CheckpointConfig(store_every_n_reports=4)),
    )
    result = fit_in_background(trainer)(150)
    timeline = assert_finished(result)
    assert result.metrics["step"] == steps
    assert [e for e in result.events if e["kind"] == "preemption_notice"], timeline
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1))
    assert_params_follow_reference(lines, steps, timeline)
    assert steps_redone(lines) == 0, timeline
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "checkpoint.pt"))
    assert state["step"] == steps, f"the last checkpoint was never stored\n{timeline}"
    assert torch.allclose(torch.cat([state["model"]["weight"].flatten(), state["model"]["bias"]]),
                          torch.tensor(reference(steps)[steps][0]), rtol=1e-5, atol=1e-6)


# == 6. Growing back during the last step ==========================================================
@pytest.mark.timeout(180)
def test_growing_back_at_the_last_report_still_stores_the_last_checkpoint(local_ray, run_dirs):
    """The same program, storing every 4th checkpoint; rank 1 is SIGKILLed at step 10 and the run
    goes on alone. Its last step (18) is long (8 s), so the replacement worker is ready during it:
    the group grows back at the last report, and the new generation has nothing left to run. The
    last checkpoint, which the cadence did not store, must still be stored before fit() returns."""
    steps = 18
    trainer = TorchTrainer(
        rank_0_saves_loop,
        train_loop_config={"steps": steps, "step_time": 0.1, "last_step_time": 8.0, "fault_step": 10,
                           "log_dir": run_dirs["log_dir"]},
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             checkpoint_config=CheckpointConfig(store_every_n_reports=4)),
    )
    result = fit_in_background(trainer)(150)
    timeline = assert_finished(result)
    assert result.metrics["step"] == steps
    assert 1 in result.world_sizes, timeline
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1))
    assert_params_follow_reference(lines, steps, timeline)
    assert steps_redone(lines) <= 1, timeline
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "checkpoint.pt"))
    assert state["step"] == steps, f"the last checkpoint was never stored\n{timeline}"


# == No checkpoint at all: the state kept live ====================================================
def kept_state_loop(config):
    """Ray Train's guide loop with no checkpoint, its model kept live: the optimizer (Adam, whose state
    matters) is built after prepare_model, on the DDP model's parameters; the loop counts its steps
    from get_context().get_resume_index()."""
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1), live_state=True)
    optimizer = adam(model.parameters())
    ctx = train.get_context()
    for step in range(ctx.get_resume_index() + 1, config["steps"] + 1):
        if step == config["at_step"] and ctx.get_world_rank() == 1 and once(config):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = my_share(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_time"])
        progress(config, step, params=flat(model))
        train.report({"step": step, "loss": loss.item()})


@pytest.mark.timeout(180)
def test_no_checkpoint_with_the_state_kept_live_loses_no_step(local_ray, run_dirs):
    """Rank 1 is SIGKILLed in a fixed run of 2: the survivor waits for its replacement, which gets the
    model and Adam's state from it. Every step's parameters are the fault-free run's, none is redone,
    and nothing was stored."""
    steps = 12
    config = {"log_dir": run_dirs["log_dir"], "steps": steps, "at_step": 6, "step_time": 0.1}
    result = TorchTrainer(kept_state_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(storage_path=run_dirs["storage"], name="run")).fit()
    timeline = assert_finished(result)
    lines = step_lines(read_progress(run_dirs["log_dir"]), result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1)), timeline
    assert_params_follow_reference(lines, steps, timeline, adam)
    assert steps_redone(lines) == 0, timeline
    assert read_marker(run_dirs["log_dir"]) and set(result.world_sizes) == {2}, timeline
    assert result.checkpoint is None
