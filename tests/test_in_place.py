"""Loops written as Ray Train's guides write them go on in place when a peer is lost mid-epoch: the
survivors complete the step among themselves, no step is redone, every sample of each epoch is used
once, and the run ends where a fault-free run through the same world sizes ends (tests/guide_loops.py).
The fault strikes the loop of one rank at a point of its step; the survivors meet it in whatever
collective comes next: the step's gradient reduction, DDP's buffers or map of used parameters, the
loop's own all-reduce, a report's barrier."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import ElasticConfig
from elastic_train.events import GenerationOpened
from elastic_train.run_folder.event_log import read_events
from tests.guide_loops import SAMPLES, completed_steps, final_state, guide_loop, replay
from chaos import schedules
from chaos.harness import ChaosRunner
from tests.chaos.scenario import attach
from tests.helpers import fit_in_background, make_trainer
from tests.loops import read_progress, sample_counting_loop
from tests.patterns import FAST_DETECTION

EPOCHS = 6


def check_run(result, log_dir: str, config: dict, paths: list[str] | None, reentered: bool = False) -> None:
    """The run finished every epoch through the recovery `paths` took (GenerationOpened.resume_from
    after the first; None: any), every sample of each epoch used once, no process computed a step
    twice (with `reentered`: but in a generation whose loops were entered afresh from a report, as
    where the lost peer's step could not be completed in place), and it ends with a fault-free run's
    state through the same steps."""
    assert result.error is None, result.error
    epochs = config["epochs"]
    assert result.metrics["epoch"] == epochs - 1
    steps = completed_steps(log_dir)
    for epoch in range(epochs):
        used = [i for (e, _), records in steps.items() if e == epoch for r in records for b in r["batches"] for i in b]
        assert sorted(used) == list(range(SAMPLES)), f"epoch {epoch}: a sample was skipped or used twice"
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    entered_afresh = {g.generation for g in opened if g.resume_from != "in place"}
    by_process: dict[int, list[tuple[int, int, int]]] = {}
    for p in read_progress(log_dir):
        if "batches" in p:
            by_process.setdefault(p["pid"], []).append((p["epoch"], p["step"], p["generation"]))
    for pid, done in by_process.items():
        redone = [now for before, now in zip(done, done[1:]) if now[:2] <= before[:2]]
        assert not redone or (reentered and all(g in entered_afresh for *_, g in redone)), \
            f"process {pid} redid a step: {done}"
    assert paths is None or [g.resume_from for g in opened][1:len(paths) + 1] == paths, opened
    expected = replay(log_dir, config)
    for name, value in final_state(result).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12)


def reentered_because(result) -> str:
    """Why the run's loops were re-entered rather than going on in place, each recovery's reason."""
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    return " | ".join(g.reentered_because for g in opened if g.reentered_because)


def run(run_dirs: dict, scaling, fault: dict | list[dict], elastic: ElasticConfig | None = None, **options):
    """A run of the guide loop with no warm spare: the survivors go on in place while the replacement
    starts (a spare ready at the loss would be in the next generation at once: tests/test_warm_spares.py)."""
    config = {"epochs": EPOCHS, "step_time": 0.1, "fault": fault} | options
    elastic = dataclasses.replace(elastic or ElasticConfig(), warm_spares_per_node=0)
    return make_trainer(run_dirs, scaling, guide_loop, elastic=elastic, **config).fit(), config


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scaling, killed", [((1, 2), 0), (2, 1)])
def test_a_worker_killed_mid_step_the_survivor_goes_on_and_the_replacement_joins_at_a_checkpoint(
        local_ray, run_dirs, scaling, killed):
    """Fixed size (2): the survivor goes on alone while the replacement starts; once it is ready, every
    loop is re-entered at the full size from the newest checkpoint in memory at the survivor's next
    step (as Ray Train restarts at its size; a world of one has no peer whose loss fails its
    collectives: worker/group/world.py `ended_alone`). Elastic (1, 2): it joins at the next report carrying a checkpoint.
    Rank 0 killed: the survivor, rank 1, read its rank in the step the peer was lost in (the loop's
    fault injection, tests/loops.py `fault_once`), and the recovery makes it rank 0: its loop is
    re-entered from memory, as Ray Train's would be, and the event names that line."""
    result, config = run(run_dirs, scaling, {"kind": "kill", "rank": killed, "at_step": 103})
    check_run(result, run_dirs["log_dir"], config, ["in place", "memory"] if killed else ["memory"],
              reentered=killed == 0 or scaling == 2)
    if killed == 0:
        assert "guide_loops.py:111 used, in the step the peer was lost in, the rank it read (1, now 0)" in \
            reentered_because(result)
    if scaling == 2:  # a fixed size: back at it at the survivor's next step once the replacement is ready
        events = read_events(RunStorage.at(result.path))
        first = next(e for e in events if e["kind"] == "generation")
        ready = next(e for e in events if e["kind"] == "worker_ready" and str(e["worker_id"]) not in map(str, first["members"]))
        alone = [p for p in read_progress(run_dirs["log_dir"]) if p["world"] == 1 and "batches" in p]
        after = [(p["epoch"], p["step"]) for p in alone if p["time"] > ready["time"]]
        assert len(after) <= 1, f"the survivor trained on alone after the replacement was ready: {after}"
    committed = RunStorage.at(result.path).committed()
    assert len(committed) == EPOCHS, f"an epoch's checkpoint was not stored: {[c.index for c in committed]}"
    regrown = [p for p in read_progress(run_dirs["log_dir"]) if p.get("generation", 0) >= 2]
    assert regrown and {p["world"] for p in regrown} == {2}, "the replacement joined at an epoch's checkpoint"


@pytest.mark.timeout(240)
def test_batch_norm_unused_parameters_and_accumulation_a_worker_killed_before_the_optimizer_step(
        local_ray, run_dirs):
    """The killed rank's step reduced its gradients: the survivor meets the loss in DDP's broadcast of
    the buffers at its next forward (or the reduction after it), and goes on from there."""
    result, config = run(run_dirs, (1, 2), {"kind": "kill", "rank": 1, "at_step": 101, "point": "before_step"},
                         batch_norm=True, unused=True, accumulate=2)
    check_run(result, run_dirs["log_dir"], config, ["in place"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_loops_own_all_reduce_of_its_loss_under_amp_a_worker_killed_after_its_optimizer_step(
        local_ray, run_dirs, killed):
    """A rank dies after its optimizer step: the survivor meets the loss in the loop's own
    `dist.all_reduce` of the loss. The loop keeps `loss = mean_loss / get_world_size()` (a value
    made from the world size, which the next step's `mean_loss = loss...` reads: faithful/sites.py
    does not follow a name's rebinding), so whichever rank is lost the loop is re-entered from memory,
    the event naming that line, and ends where a fault-free run through the same world sizes ends.
    AMP's GradScaler scales what the comm hook reduces. (A loop's own all-reduce made again in place:
    `test_a_loop_without_ddp_whose_peer_dies_before_its_report_goes_on_in_place`.)"""
    result, config = run(run_dirs, (1, 2), {"kind": "kill", "rank": killed, "at_step": 102, "point": "after_step"},
                         all_reduce_loss=True, amp=True)
    check_run(result, run_dirs["log_dir"], config, ["memory"], reentered=True)
    assert "guide_loops.py:134 holds the world size it read (2, now 1)" in reentered_because(result)


@pytest.mark.timeout(240)
def test_workers_killed_at_reports_the_survivor_agrees_each_alone(local_ray, run_dirs):
    """Rank 0 killed while saving epoch 1's checkpoint: the survivor, rank 1, decided at that report
    not to save by the rank it held there (`_report`'s `rank`), and is rank 0 now: its loop is
    re-entered from memory once the replacement is ready (a fixed size: as Ray Train does), and
    epoch 1 is saved. Then rank 1 as it calls epoch 6's report(): the survivor, rank 0 still, passes
    its report barrier in place."""
    faults = [{"kind": "kill", "rank": 0, "at_step": 199, "point": "saving"},
              {"kind": "kill", "rank": 1, "at_step": 699, "point": "report"}]
    result, config = run(run_dirs, 2, faults, epochs=8)  # the replacement has joined by epoch 6's end
    check_run(result, run_dirs["log_dir"], config, ["memory", "in place"], reentered=True)
    assert "rank it read (1, now 0)" in reentered_because(result)
    committed = RunStorage.at(result.path).committed()
    assert len(committed) == 8, f"an epoch's checkpoint was not stored: {[c.index for c in committed]}"


@pytest.mark.timeout(240)
def test_a_worker_stopped_mid_step_is_dropped_and_the_survivor_goes_on(local_ray, run_dirs):
    """SIGSTOP: the survivor's collective waits until the supervisor finds the stopped worker silent
    (heartbeat_timeout_s) and aborts the group; it goes on in place then."""
    result, config = run(run_dirs, (1, 2), {"kind": "stop", "rank": 1, "at_step": 103},
                         elastic=ElasticConfig(**FAST_DETECTION))
    check_run(result, run_dirs["log_dir"], config, ["in place"])


@pytest.mark.timeout(240)
def test_a_preemption_notice_the_survivor_goes_on_from_the_report_where_the_worker_leaves(local_ray, run_dirs):
    """SIGTERM to rank 1 mid-epoch, in a loop that reports metrics every step and a checkpoint every
    epoch: every rank leaves the group at the next report, which carries no checkpoint; the survivor
    goes on from there rather than from the epoch's checkpoint (until the replacement is ready: then
    every loop re-enters at the full size, from the newest checkpoint)."""
    result, config = run(run_dirs, 2, {"kind": "term", "rank": 1, "at_step": 103}, report_every_step=True,
                         elastic=ElasticConfig(preemption_sigterm_grace_s=5.0))
    check_run(result, run_dirs["log_dir"], config, ["in place"], reentered=True)


@pytest.mark.timeout(300)
def test_random_workers_killed_from_outside_every_few_seconds(local_ray, run_dirs):
    """The chaos harness SIGKILLs a random worker every 3 s (once two train again: the lone survivor's
    death would start the run over from storage), wherever its loop stands; the survivor goes on in
    place each time, or, where the recovery renumbers a rank the loop read, is re-entered from memory
    (the event says why), and the replacement joins at an epoch's checkpoint."""
    config = {"epochs": 10, "step_time": 0.1, "log_dir": run_dirs["log_dir"]}
    join = fit_in_background(make_trainer(run_dirs, (1, 2), guide_loop, **config))
    ctx = attach(run_dirs, 2)

    def two_train(since: float) -> bool:
        latest = [p for p in read_progress(run_dirs["log_dir"]) if "batches" in p][-2:]
        return len(latest) == 2 and all(p["world"] == 2 and p["time"] > since for p in latest)

    runner = ChaosRunner(ctx, schedules.every(3.0, 2), fault="sigkill", target="random", seed=1,
                         ready=two_train).start()
    result = join(240)
    runner.stop()
    assert len([e for e in ctx.log.entries if e["kind"] == "sigkill"]) == 2
    check_run(result, run_dirs["log_dir"], config, None, reentered=True)
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    recovered = [g for g in opened if g.resume_from == "in place" or g.reentered_because is not None]
    assert len(recovered) == 2, opened
    assert all(g.resume_from == "in place" or "rank it read" in g.reentered_because for g in recovered), opened


@pytest.mark.timeout(240)
def test_a_loop_without_ddp_whose_peer_dies_before_its_report_goes_on_in_place(local_ray, run_dirs):
    """tests/loops.py `sample_counting_loop`: no DDP, its own `dist.all_reduce` of each step's sample
    counts, a checkpoint every step. Rank 1 dies after its step's all-reduce, before its report: the
    survivor's report barrier passes in place and the batch it just trained is not owed again."""
    config = {"samples": 48, "epochs": 3, "global_batch_size": 8, "step_time": 0.05,
              "fault": {"kind": "kill", "rank": 1, "at_step": 7, "point": "before_report"}}
    result = make_trainer(run_dirs, (1, 2), sample_counting_loop, **config).fit()
    assert result.error is None, result.error
    assert result.metrics == {"step": 18, "epoch": 2}
    assert result.checkpoint.to_dict()["counts"].tolist() == [3.0] * 48, "a sample was skipped or repeated"
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    assert opened[1].resume_from == "in place", opened


@pytest.mark.timeout(30)
def test_a_rank_lost_once_its_gradients_were_reduced_counts_in_its_step(tmp_path):
    """As a full run showed it: rank 0 was SIGKILLed in step 6 after the step's all-reduce had its
    gradients, before it logged the step; its peer completed and logged the step in the same
    generation, so rank 0's drawn batches are in the step. At step 7 a rank lost mid-reduction: the
    survivor reduced again alone, in the next generation; the lost rank's batches are owed, not counted."""
    lines = [
        {"pid": 1, "generation": 2, "rank": 1, "world": 2, "epoch": 6, "step": 6, "drawn": [[12, 55]]},
        {"pid": 2, "generation": 2, "rank": 0, "world": 2, "epoch": 6, "step": 6, "drawn": [[4, 25]]},
        {"pid": 1, "generation": 2, "rank": 1, "world": 2, "epoch": 6, "step": 6, "batches": [[12, 55]]},
        {"pid": 1, "generation": 3, "rank": 0, "world": 2, "epoch": 6, "step": 7, "drawn": [[19, 20]]},
        {"pid": 3, "generation": 3, "rank": 1, "world": 2, "epoch": 6, "step": 7, "drawn": [[7, 59]]},
        {"pid": 1, "generation": 4, "rank": 0, "world": 1, "epoch": 6, "step": 7, "batches": [[19, 20]]},
    ]
    (tmp_path / "progress.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = completed_steps(str(tmp_path))
    assert sorted(r["batches"] for r in steps[(6, 6)]) == [[[4, 25]], [[12, 55]]]
    assert [r["batches"] for r in steps[(6, 7)]] == [[[19, 20]]]
