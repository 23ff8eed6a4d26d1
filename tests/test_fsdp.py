"""`prepare_model(parallel_strategy="fsdp", live_state=True)` on real Ray: a transformer block stack
sharded with FSDP2 over the generation's world, AdamW and an LR scheduler, its state kept as each
rank's share. A rank SIGKILLed: the survivors re-shard the last report's state from their own shares
and the lost rank's replica on its buddy, with no storage read; a replacement receives its rows the
same way; a rank lost with its buddy: the run resumes from the loop's DCP checkpoint at the new size.
Each generation's restored parameters equal the last report's bit for bit; every step's loss and
parameters, the final weights among them, equal a fault-free run's that follows the same world-size
schedule bit for bit (and its loss is the single-process run's, within float error). The shares are copied at every report (`sharded_state_budget=1.0`) where the
machine keeps up with it (tests/test_sharded_state.py covers the cadence).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

import elastic_train as train
from elastic_train import Checkpoint, ElasticConfig, RunConfig, ScalingConfig
from elastic_train.torch import TorchTrainer, get_device, keep_state, load_state, prepare_model, save_state
from tests.fsdp_reference import LR_STEP, batch, blocks, digest, same_schedule_without_faults, train_step, wrapping
from tests.loops import log_progress, read_progress
from tests.patterns import assert_losses, fault_free_losses, step_lines, summary

STEPS = 30


def fsdp_kept_loop(config: dict) -> None:
    ctx = train.get_context()
    device = get_device()
    model = prepare_model(blocks(), parallel_strategy="fsdp", live_state=True, parallel_strategy_kwargs=wrapping())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = keep_state(torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=0.5))
    start = ctx.get_resume_index()
    checkpoint = train.get_checkpoint()
    if checkpoint:  # the loop's own DCP checkpoint: where a rank and its buddy were lost together
        with checkpoint.as_directory() as directory:
            extra = load_state(directory, model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        start = extra["step"]
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    restored = digest(model)
    if rank == 0:
        log_progress(config["log_dir"], restored=restored, at=start, generation=ctx.get_generation(), world=world)
    for step in range(start + 1, config["steps"] + 1):
        time.sleep(config["step_time"])  # the last report's share reaches the buddy meanwhile
        for n, kill in enumerate(config["kills"]):
            due = step >= kill["step"] and world == kill.get("world", world)  # at that size, if given
            if due and rank in kill["ranks"] and _once(config, f"kill{n}-rank{rank}"):
                os.kill(os.getpid(), signal.SIGKILL)
        loss = train_step(model, optimizer, scheduler, step, rank, world, device)
        state = digest(model)
        if rank == 0:
            log_progress(config["log_dir"], step=step, loss=loss, digest=state, rank=rank,
                         world=world, generation=ctx.get_generation())
        if step == config.get("rank_0_saves") and rank == 0:  # Ray's "rank 0 saves" pattern: the others report none
            with tempfile.TemporaryDirectory() as directory:
                Path(directory, "step.json").write_text(json.dumps({"step": step}))
                train.report({"step": step}, checkpoint=Checkpoint.from_directory(directory))
        elif step % config["checkpoint_every"] == 0:
            with tempfile.TemporaryDirectory() as directory:
                save_state(directory, model, optimizer, extra={"step": step, "scheduler": scheduler.state_dict()})
                train.report({"step": step}, checkpoint=Checkpoint.from_directory(directory))
        else:
            train.report({"step": step})


def assert_same_as_the_schedule_without_faults(lines: list[dict], steps: int, scratch: Path, timeline: str) -> None:
    """The run's steps, as last computed (a redone step: its last generation's), against a fault-free
    run following the same world-size schedule (tests/fsdp_reference.py): every step's loss and
    parameters bit for bit, the final weights among them."""
    final: dict[int, dict] = {}
    for p in lines:
        if p["step"] not in final or p["generation"] >= final[p["step"]]["generation"]:
            final[p["step"]] = p
    segments: list[list[int]] = []  # [world size, first step, last step]
    for step in range(1, steps + 1):
        if segments and segments[-1][0] == final[step]["world"]:
            segments[-1][2] = step
        else:
            segments.append([final[step]["world"], step, step])
    reference = same_schedule_without_faults(segments, scratch)
    wrong = [f"step {s} at world {final[s]['world']}: {(final[s]['loss'], final[s]['digest'])} != {tuple(reference[s])}"
             for s in range(1, steps + 1) if (final[s]["loss"], final[s]["digest"]) != tuple(reference[s])]
    assert not wrong, f"schedule {segments}\n" + "\n".join(wrong) + f"\n{timeline}"


def _once(config: dict, name: str) -> bool:
    try:
        os.close(os.open(os.path.join(config["log_dir"], f"{name}.marker"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def fit(run_dirs: dict, workers: tuple[int, int], kills: list[dict], checkpoint_every: int = STEPS + 1,
        gpu_share: float | None = None, tolerance: float = 1e-5, rank_0_saves: int | None = None, steps: int = STEPS):
    """fsdp_kept_loop with `kills`; on CPUs, or on GPUs (`gpu_share` of one per worker, over NCCL): each
    step redone at a world size gives the loss it gave the first time, and each loss is within
    `tolerance` of the fault-free run's (computed on the CPU); on CPUs, every step's loss and
    parameters equal a fault-free run's at the same world sizes, bit for bit."""
    config = {"log_dir": run_dirs["log_dir"], "kills": kills, "step_time": 0.12, "checkpoint_every": checkpoint_every,
              "rank_0_saves": rank_0_saves, "steps": steps}
    scaling = (ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}) if gpu_share is None else
               ScalingConfig(num_workers=workers, use_gpu=True, resources_per_worker={"GPU": gpu_share}))
    result = TorchTrainer(fsdp_kept_loop, train_loop_config=config, scaling_config=scaling,
                          run_config=RunConfig(storage_path=run_dirs["storage"], name="run",
                                               # the shrink and the growth that re-shard: no warm spare takes the
                                               # lost rank's place at once (tests/test_warm_spares.py)
                                               elastic_config=ElasticConfig(sharded_state_budget=1.0,
                                                                            warm_spares_per_node=0))).fit()
    timeline = summary(result)
    assert result.error is None, f"{str(result.error)[-3000:]}\n{timeline}"
    progress = read_progress(run_dirs["log_dir"])
    lines = step_lines(progress, result)
    assert {p["step"] for p in lines} == set(range(1, steps + 1)), timeline
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=LR_STEP, gamma=0.5)
    assert_losses(lines, fault_free_losses(blocks(), batch, steps, scheduler), timeline, tolerance)
    # Each generation's restored parameters are those of the report it resumed from, bit for bit.
    reported = {(p["generation"], p["step"]): p["digest"] for p in lines}
    generations = [e for e in result.events if e["kind"] == "generation"]
    for restore in [p for p in progress if "restored" in p and p["generation"] > 0]:
        earlier = [d for (g, s), d in reported.items() if s == restore["at"] and g < restore["generation"]]
        assert earlier and earlier[-1] == restore["restored"], f"{restore}\n{timeline}"
    if gpu_share is None:
        assert_same_as_the_schedule_without_faults(lines, steps, Path(run_dirs["storage"], "reference"), timeline)
    return result, generations, timeline


@pytest.mark.timeout(240)
def test_a_lost_rank_of_3_is_resharded_to_2_from_memory_and_its_replacement_gets_its_rows(local_ray, run_dirs):
    """Rank 1 of 3 SIGKILLed at step 8: the survivors go on at 2 from report 7, re-sharded from their own
    shares and rank 1's replica (held by rank 2); the replacement joins, and the 3 ranks go on from the
    2 ranks' shares. No step is redone, nothing is read from storage. At step 27 rank 0 alone reports a
    checkpoint, the others none: every rank still makes the report's one agreement on copying."""
    result, generations, timeline = fit(run_dirs, (2, 3), [{"step": 8, "ranks": [1]}], rank_0_saves=27)
    assert [e["world_size"] for e in generations][:3] == [3, 2, 3], timeline
    assert [e["resume_from"] for e in generations[1:]] == ["memory"] * (len(generations) - 1), timeline
    assert generations[1]["resume_index"] == 7, timeline
    steps = [p["step"] for p in step_lines(read_progress(run_dirs["log_dir"]), result)]
    assert len(steps) == STEPS, f"steps redone: {sorted(steps)}\n{timeline}"


@pytest.mark.timeout(240)
def test_2_to_1_from_memory_then_a_rank_with_its_buddy_lost_resumes_from_the_dcp_checkpoint(local_ray, run_dirs):
    """2 ranks: rank 1 SIGKILLed at step 8, rank 0 goes on alone from both shares (its own, and rank
    1's replica); a replacement joins (1 -> 2). At the first step from 50 on at 2 ranks, both are
    SIGKILLed, each the other's buddy: no share of the report before survives, and the run resumes
    from the loop's newest DCP checkpoint (every 5 steps) on the replacements, at the size they come
    back at."""
    result, generations, timeline = fit(run_dirs, (1, 2), [{"step": 8, "ranks": [1]},
                                                           {"step": 50, "ranks": [0, 1], "world": 2}],
                                        checkpoint_every=5, steps=60)
    assert [e["world_size"] for e in generations][:3] == [2, 1, 2], timeline
    assert (generations[1]["resume_from"], generations[1]["resume_index"]) == ("memory", 7), timeline
    lost_both = [e for e in generations if e["resume_from"] == "storage"]
    assert lost_both and lost_both[0]["resume_index"] in (45, 50, 55), timeline
