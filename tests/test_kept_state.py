"""A loop with no checkpoint loses no step to a lost peer: `prepare_model(model, live_state=True)` keeps
the model's state and its optimizer's live, each report holds them by reference, and a recovery loads
them back into the re-entered loop's new model and optimizer. Nothing of it is ever stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import elastic_train as et
from elastic_train.checkpoint.checkpoint import DICT_FILE, STATE_FILE, dict_from_bytes
from elastic_train.protocol import HeldCheckpoint
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.torch import keep_state, prepare_model
from elastic_train.worker.hold.kept_state import KeptState
from elastic_train.worker.hold.parts import HeldParts
from tests.chaos.scenario import chaos_trainer, check_invariants
from tests.loops import (batch_norm_loop, batch_norm_model, batch_norm_optimizer, batch_norm_step, fault_once,
                         read_progress)


# The step time of runs that need a replacement to join before they end: their ~53 steps after the
# fault leave it ~6 s to start and join on a loaded machine (0.08 s steps once left it too little).
JOIN_STEP_S = 0.12


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


@pytest.mark.timeout(30)
def test_kept_state_restores_the_model_at_once_and_each_optimizer_at_its_first_step():
    model = _model()
    kept = KeptState(model, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    other = torch.nn.Linear(2, 1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    _step(model, optimizer)
    _step(model, optimizer)
    other_optimizer.step()  # another model's optimizer is not the state kept
    part = kept.snapshot()
    assert part.names == [STATE_FILE] and part.state_only and part.clean()
    state = dict_from_bytes(part.files()[STATE_FILE])
    assert len(state["optimizers"]) == 1 and state["optimizers"][0]["state"]  # its momentum buffers
    kept.close()

    # A new generation re-enters the loop: a fresh model and optimizer, restored from the held state.
    fresh = _model()
    restored = KeptState(fresh, state)
    assert torch.equal(fresh.weight, model.weight)  # loaded at once (prepare_model)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    assert restored.snapshot().data["optimizers"] == state["optimizers"]  # not stepped yet: the restored state counts
    _step(fresh, fresh_optimizer)
    _step(model, optimizer)  # the same step with the state never lost
    assert torch.equal(fresh.weight, model.weight)  # the momentum was loaded before the step ran
    restored.close()
    _step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))  # no longer watched once its generation closed


@pytest.mark.timeout(30)
def test_a_kept_state_stays_live_when_its_generation_ends_and_is_serialized_only_for_a_peer():
    """A survivor resumes from its own tensors (no torch.save and load of its whole state); a newcomer's
    copy is serialized when it asks. A loop that keeps its model object across generations restores
    without writing it, so the held state can still serve."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = KeptState(model, None)
    _step(model, optimizer)
    part = kept.snapshot()
    kept.close()
    memory = HeldParts(keep=2)
    memory.put(HeldCheckpoint(3, 0, 0, [STATE_FILE], []), part)
    memory.freeze()
    assert memory.live_state(0, 3) is part.data
    served = dict_from_bytes(memory.find(0, 3, [STATE_FILE])[STATE_FILE])
    assert torch.equal(served["model"]["weight"], model.weight)
    KeptState(model, memory.live_state(0, 3)).close()  # the same model object: nothing written
    assert part.clean()
    _step(model, optimizer)  # written to: neither resumed from nor served, and dropped when settled
    assert memory.live_state(0, 3) is None and memory.find(0, 3, [STATE_FILE]) == {}
    memory.freeze()
    assert (0, 3) not in memory.keys()


@pytest.mark.timeout(30)
def test_a_kept_state_is_built_when_read_as_it_was_at_its_report():
    """A report notes the state's tensors and builds no state dict; read later, it is the report's state:
    the learning rate a scheduler set since is not in it. A tensor the report did not note (a parameter
    replaced since) makes it no longer clean: never served, never resumed from."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    kept = KeptState(model, None)
    _step(model, optimizer)
    reported = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizers": [optimizer.state_dict()]}
    part = kept.snapshot()
    scheduler.step()  # lr 0.1 -> 0.05, no tensor written
    assert optimizer.param_groups[0]["lr"] == 0.05 and part.clean()
    state = dict_from_bytes(part.files()[STATE_FILE])
    assert state["optimizers"][0]["param_groups"] == reported["optimizers"][0]["param_groups"]
    assert torch.equal(state["optimizers"][0]["state"][0]["momentum_buffer"],
                       reported["optimizers"][0]["state"][0]["momentum_buffer"])
    for name, tensor in reported["model"].items():
        assert torch.equal(state["model"][name], tensor), name

    part = kept.snapshot()
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # none of the noted tensors written
    assert part.clean()
    memory = HeldParts(keep=2)
    memory.put(HeldCheckpoint(2, 0, 0, [STATE_FILE], []), part)
    assert memory.live_state(0, 2) is None and not part.clean() and part.files() is None
    kept.close()


@pytest.mark.timeout(30)
def test_a_scheduler_kept_with_the_state_goes_on_with_its_schedule_after_a_recovery():
    """A StepLR handed to the kept state: a recovery loads its step count into the re-entered loop's new
    scheduler, and the learning rate halves at the fault-free run's steps. Without it the new scheduler
    counts from the resume: the rate halves late."""
    def run(steps: int, kept: KeptState, model: torch.nn.Module, keep: bool = True):
        optimizer, scheduler = batch_norm_optimizer(model)
        if keep:
            kept.keep(scheduler)
        for step in steps:
            batch_norm_step(model, optimizer, step)
            scheduler.step()
        return scheduler, optimizer

    model = batch_norm_model()
    kept = KeptState(model, None)
    run(range(1, 7), kept, model)
    state = dict_from_bytes(kept.snapshot().files()[STATE_FILE])  # report 6; a peer is lost in step 7
    kept.close()
    reference = batch_norm_model()
    watched = KeptState(reference, None)
    scheduler, _ = run(range(1, 13), watched, reference)
    watched.close()
    for keep in (True, False):
        fresh = batch_norm_model()
        restored = KeptState(fresh, state)
        resumed, _ = run(range(7, 13), restored, fresh, keep)
        restored.close()
        assert (resumed.get_last_lr() == scheduler.get_last_lr()) is keep, (keep, resumed.get_last_lr())
        assert torch.allclose(fresh[0].weight, reference[0].weight) is keep


class _Seen:
    """A loop's own counter, its state a tensor."""

    def __init__(self) -> None:
        self.samples = torch.zeros((), dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"].clone()


@pytest.mark.timeout(30)
def test_an_object_kept_with_a_tensor_in_its_state_serves_as_it_was_at_the_report():
    model = _model()
    kept = KeptState(model, None)
    seen = _Seen()
    kept.keep(seen)
    seen.samples += 32
    part = kept.snapshot()
    seen.samples += 32  # the loop goes on counting: the report's copy stays 32
    state = dict_from_bytes(part.files()[STATE_FILE])
    assert state["objects"][0]["samples"].item() == 32 and part.clean()
    kept.close()
    restored, fresh = KeptState(_model(), state), _Seen()
    restored.keep(fresh)
    assert fresh.samples.item() == 32
    restored.close()


@pytest.mark.timeout(30)
def test_a_kept_state_holds_copies_of_the_buffers_that_a_forward_writes():
    """BatchNorm's forward writes its running statistics (with no version bump) and its batch counter
    before the step's collectives: a report's state holds copies of them, so a forward after it leaves
    the held state clean and as reported. Restored into the model object the loop kept, the buffers go
    back to the report's, and its parameters (the held tensors themselves) are not written."""
    model = batch_norm_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    kept = KeptState(model, None)
    batch_norm_step(model, optimizer, 1)
    reported = {k: v.clone() for k, v in model.state_dict().items()}
    part = kept.snapshot()
    model(torch.randn(16, 4))  # the next step's forward; its all-reduce fails
    assert part.clean() and not torch.equal(model[1].running_mean, reported["1.running_mean"])
    for name, tensor in reported.items():
        assert torch.equal(part.data["model"][name], tensor), name
    kept.close()
    KeptState(model, part.data).close()
    assert part.clean()
    for name, tensor in reported.items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.timeout(30)
def test_a_kept_state_serves_a_resume_but_is_never_stored():
    ledger = CheckpointLedger(keep=2)
    for rank, worker in ((0, 10), (1, 11)):
        ledger.record(0, 2, 4, rank, worker, [STATE_FILE], {"step": 4}, [{"epoch": 0, "position": 32}])
    plan = ledger.resume_plan({11})
    assert (plan.index, plan.holders, plan.state_only) == (4, {11: [STATE_FILE]}, True)
    assert not ledger.entries[4].to_store and not plan.store
    ledger.record(0, 2, 5, 0, 10, [DICT_FILE], {"step": 5}, [])
    ledger.record(0, 2, 5, 1, 11, [DICT_FILE], {"step": 5}, [])
    assert not ledger.resume_plan({11}).state_only  # a checkpoint the loop reported is get_checkpoint()'s


def _fault_time(run_dirs: dict) -> float:
    return json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())["time"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point, resumed_at", [("step_start", 6), ("before_report", 7)])
def test_a_loop_with_no_checkpoint_loses_no_step_to_a_lost_peer(local_ray, run_dirs, point, resumed_at):
    """The invariant loop with no checkpoint, its SGD with momentum. Rank 1 is SIGKILLed at step 7:
    before the step's collectives (the survivor's state is still report 6's) or after them, before its
    report (the survivor's state is step 7's, though report 7's barrier failed). The run goes on from
    there with no step redone; Ray replaces the worker, which gets the state from the survivor. It ends
    with a fault-free run's parameters and optimizer, every sample once per epoch, and nothing stored."""
    fault = {"kind": "kill", "rank": 1, "at_step": 7, "point": point}
    result = chaos_trainer(run_dirs, (1, 2), step_time=JOIN_STEP_S, live_state=True, fault=fault,
                           elastic=et.ElasticConfig(warm_spares_per_node=0)).fit()  # the survivor goes on alone
    check_invariants(result, run_dirs, faults=1, redone_per_fault=0, live_state=True)
    after = [e for e in result.events if e["kind"] == "generation" and e["time"] > _fault_time(run_dirs)]
    assert (after[0]["resume_from"], after[0]["resume_index"], after[0]["world_size"]) == ("memory", resumed_at, 1)
    assert max(e["world_size"] for e in after) == 2  # the replacement joined, from the survivor's state


@pytest.mark.timeout(180)
@pytest.mark.parametrize("live_state, point", [(True, "step_start"), (False, "start")],
                         ids=["kept-state", "checkpoint-every-step"])
def test_the_survivor_lost_as_its_replacement_joins(local_ray, run_dirs, live_state, point):
    """Rank 1 is SIGKILLed; its replacement joins the survivor, and the survivor is SIGKILLed as that
    generation begins. With the state kept live nothing was stored: the survivor dies at its first step,
    before the generation's first report, and the replacement holds the copy it fetched (the supervisor
    knows it before the replacement goes on), so the run goes on from it and no step is redone. With a
    checkpoint every step the survivor dies before its loop starts, maybe while the replacement fetches
    the resume checkpoint from it: that ends the generation (it is no error of the loop's), and the run
    goes on from the newest stored checkpoint."""
    faults = [{"kind": "kill", "rank": 1, "at_step": 7}, {"kind": "kill", "rank": 0, "at_generation": 2,
                                                           "point": point}]
    result = chaos_trainer(run_dirs, (1, 2), step_time=JOIN_STEP_S, live_state=live_state, fault=faults,
                           elastic=et.ElasticConfig(warm_spares_per_node=0)).fit()  # a replacement joins, not a spare
    check_invariants(result, run_dirs, faults=2, redone_per_fault=0 if live_state else 1, live_state=live_state)
    generations = [e for e in result.events if e["kind"] == "generation"]
    assert [e["world_size"] for e in generations[:4]] == [2, 1, 2, 1], generations
    if live_state:
        assert [e["resume_from"] for e in generations] == [None] + ["memory"] * (len(generations) - 1), generations
        assert generations[3]["resume_index"] == generations[2]["resume_index"]  # generation 2 made no report


def _kept_loop_reporting_a_checkpoint(config: dict) -> None:
    """The state kept live, and rank 0 reports a checkpoint every 5th step, which the loop never loads."""
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(3, 1), live_state=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = et.get_context()
    for step in range(ctx.get_resume_index() + 1, config["steps"] + 1):
        fault_once(config, step, ctx.get_world_rank())
        _step(model, optimizer)
        saved = step % 5 == 0 and ctx.get_world_rank() == 0
        et.report({"step": step}, checkpoint=et.Checkpoint.from_dict({"step": step}) if saved else None)


@pytest.mark.timeout(120)
def test_a_kept_loop_that_resumes_from_a_checkpoint_it_never_loads_fails_with_the_fix(local_ray, run_dirs):
    """Rank 1 is lost as step 6 begins: the newest state is report 5's, where rank 0 reported a
    checkpoint (a rank's kept state is dropped at a report where a peer reports a checkpoint). The loop
    never loads it, so re-entering would train a fresh model from step 6: the run fails, naming the fix.
    (Its survivor, rank 0 still, would go on in place: `recover_in_place=False` makes it re-enter.)"""
    fault = {"kind": "kill", "rank": 1, "at_step": 6}
    trainer = et.TorchTrainer(
        _kept_loop_reporting_a_checkpoint, train_loop_config={"steps": 10, "log_dir": run_dirs["log_dir"],
                                                              "fault": fault},
        scaling_config=et.ScalingConfig(num_workers=(1, 2)),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name="run",
                                elastic_config=et.ElasticConfig(recover_in_place=False)))
    with pytest.raises(et.TrainingFailedError, match=r"resumed from checkpoint 5.*did not load it"):
        trainer.fit()


def _keeps_a_scheduler_without_a_kept_state(config: dict) -> None:
    model = prepare_model(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    keep_state(torch.optim.lr_scheduler.StepLR(optimizer, step_size=4))


@pytest.mark.timeout(60)
def test_keeping_a_scheduler_without_a_kept_state_fails_with_the_fix(local_ray, run_dirs):
    trainer = et.TorchTrainer(_keeps_a_scheduler_without_a_kept_state, scaling_config=et.ScalingConfig(num_workers=1),
                              run_config=et.RunConfig(storage_path=run_dirs["storage"], name="run"))
    with pytest.raises(et.TrainingFailedError, match=r"keep_state\(StepLR\).*prepare_model\(model, live_state=True\)"):
        trainer.fit()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point, in_place", [("step_start", True), ("after_forward", True), ("after_forward", False)])
def test_a_batch_norm_model_under_ddp_defaults_loses_no_step_to_a_peer_lost_mid_step(local_ray, run_dirs, point,
                                                                                     in_place):
    """A user's model with BatchNorm under DDP's defaults: its forward writes the running statistics
    (DDP broadcasts rank 0's first) before the step's gradient all-reduce; its StepLR is kept with it
    (`keep_state`). Rank 1 is SIGKILLed at step 7: as it begins (the survivor's buffer broadcast fails
    before its forward), or after its forward (the survivor's forward of step 7 has run when its
    all-reduce fails). The survivor, rank 0 still, goes on in place from report 6, no step redone,
    and the run ends with a fault-free run's parameters, running statistics, momentum and learning
    rate: step 7's forward wrote the statistics once, and the schedule halves the rate after step 8.
    Re-entered instead (`recover_in_place=False`), from report 6's kept state in memory, the same: the
    statistics held for report 6 are report 6's, not those step 7's forward wrote, and the schedule
    goes on from step 6, not from 0."""
    steps = 12
    result = et.TorchTrainer(
        batch_norm_loop,
        train_loop_config={"steps": steps, "step_time": 0.08, "log_dir": run_dirs["log_dir"],
                           "fault": {"kind": "kill", "rank": 1, "at_step": 7, "point": point}},
        scaling_config=et.ScalingConfig(num_workers=(1, 2)),
        run_config=et.RunConfig(name="run", storage_path=run_dirs["storage"],
                                elastic_config=et.ElasticConfig(recover_in_place=in_place)),
    ).fit()
    after = [e for e in result.events if e["kind"] == "generation" and e["time"] > _fault_time(run_dirs)]
    assert (after[0]["resume_from"], after[0]["resume_index"]) == ("in place" if in_place else "memory", 6), after
    done = [p["step"] for p in read_progress(run_dirs["log_dir"]) if p["rank"] == 0]
    assert sorted(done) == list(range(1, steps + 1)), done  # every step once: none redone, none skipped

    model = batch_norm_model()
    optimizer, scheduler = batch_norm_optimizer(model)
    for step in range(1, steps + 1):
        batch_norm_step(model, optimizer, step)
        scheduler.step()
    final = result.return_value
    assert final["lr"] == scheduler.get_last_lr()
    for name, tensor in model.state_dict().items():
        assert torch.allclose(final["model"][name], tensor, atol=1e-6), name
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.allclose(final["optimizer"][index]["momentum_buffer"], state["momentum_buffer"], atol=1e-6)
