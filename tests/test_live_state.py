"""Live-state recovery: a dict checkpoint is held as the live tensors it names, serialized only to be
stored or served, and a report whose barrier failed after its step's collective still counts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import elastic_train as et
from elastic_train.checkpoint.catalog import list_checkpoints, verify_checkpoint
from elastic_train.checkpoint.checkpoint import DICT_FILE, METADATA_FILE, dict_from_bytes, needs_replica
from elastic_train.protocol import HeldCheckpoint
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.hold.parts import HeldParts
from elastic_train.worker.report.barrier import Agreed
from tests.loops import read_progress, sample_counting_loop


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def _live(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> LivePart:
    return LivePart.of(et.Checkpoint.from_dict({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                "step": step}))


@pytest.mark.timeout(30)
def test_a_live_part_is_clean_until_the_optimizer_writes_its_tensors():
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)  # the momentum buffers exist from here on
    part = _live(model, optimizer, 1)
    assert part.names == [DICT_FILE] and part.clean()
    model(torch.ones(2, 3)).sum().backward()  # a forward and backward write no parameter
    assert part.clean()
    restored = dict_from_bytes(part.files()[DICT_FILE])
    assert torch.equal(restored["model"]["weight"], model.weight) and restored["step"] == 1
    optimizer.step()
    assert not part.clean() and part.files() is None  # never the newer state under report 1's name
    with_metadata = et.Checkpoint.from_dict({"step": 1})
    with_metadata.set_metadata({"epoch": 0})
    assert LivePart.of(with_metadata).names == sorted([DICT_FILE, METADATA_FILE])
    assert set(LivePart.of(with_metadata).files()) == {DICT_FILE, METADATA_FILE}


@pytest.mark.timeout(30)
def test_memory_keeps_one_live_part_and_settles_it_into_files_or_drops_it():
    model, optimizer = _model_and_optimizer()
    memory = HeldParts(keep=3)
    stored = {DICT_FILE: b"stored"}
    memory.put(HeldCheckpoint(1, 0, 0, [DICT_FILE], []), stored)
    memory.put(HeldCheckpoint(2, 0, 0, [DICT_FILE], []), _live(model, optimizer, 2))
    memory.put(HeldCheckpoint(3, 0, 0, [DICT_FILE], []), _live(model, optimizer, 3))
    assert memory.keys() == [(0, 1), (0, 3)]  # part 2 holds the same tensors as part 3: superseded
    assert dict_from_bytes(memory.find(0, 3, [DICT_FILE])[DICT_FILE])["step"] == 3  # served while clean
    memory.freeze()
    assert memory.find(0, 1, [DICT_FILE]) == stored
    _step(model, optimizer)  # a settled part is its files: the tensors may move on
    assert dict_from_bytes(memory.get(0, 3, [DICT_FILE])[DICT_FILE])["step"] == 3

    memory.put(HeldCheckpoint(4, 1, 0, [DICT_FILE], []), _live(model, optimizer, 4))
    _step(model, optimizer)  # the loop went on past report 4, and then its generation ended
    assert memory.find(1, 4, [DICT_FILE]) == {}  # never served once written to
    memory.freeze()
    assert (1, 4) not in memory.keys() and (0, 3) in memory.keys()


@pytest.mark.timeout(30)
def test_an_unagreed_report_counts_as_made_and_is_stored_by_its_holder_when_due():
    ledger = CheckpointLedger(keep=2)
    for rank, worker in ((0, 10), (1, 11)):
        ledger.record(0, 2, 5, rank, worker, [DICT_FILE], {"step": 5}, [{"epoch": 0, "position": 40}])
    # Rank 1 died after step 6's all-reduce; rank 0 holds the live part of report 6, whose barrier failed.
    entry = ledger.record_unagreed(0, 2, 6, 0, 10, [DICT_FILE], {"step": 6}, [{"epoch": 0, "position": 48}])
    assert entry.whole and not entry.complete and not entry.stored
    plan = ledger.resume_plan({10}, {10: {(0, 5, DICT_FILE), (0, 6, DICT_FILE)}})
    assert (plan.index, plan.holders, plan.loader_states) == (6, {10: [DICT_FILE]}, [{"epoch": 0, "position": 48}])
    assert not plan.store  # not chosen to be stored (a cadence skipped it)
    entry.to_store = True
    assert ledger.resume_plan({10}, {10: {(0, 5, DICT_FILE), (0, 6, DICT_FILE)}}).store
    # Rank 1 alone held it: rank 0 did not, so report 5 is where the run goes on.
    survivor_only = ledger.record_unagreed(0, 2, 7, 1, 11, [DICT_FILE], {"step": 7}, [{"epoch": 0, "position": 56}])
    assert survivor_only.loader_states == [{"epoch": 0, "position": 56}]  # no rank 0 report: the holder's positions
    assert ledger.resume_plan({10}, {10: {(0, 5, DICT_FILE)}}).index == 5
    assert [i for i, _ in ledger.close(0)] == [6, 7]  # made by all: counted when the generation closes


@pytest.mark.timeout(30)
def test_a_report_whose_sender_died_is_made_by_all_when_the_generation_closes():
    """Every report is sent after its barrier passed; a rank killed with its report still queued leaves
    it incomplete. Closing the generation counts it as made; a dict part then serves it whole, a
    directory part (another rank's shard may be missing) never."""
    ledger = CheckpointLedger(keep=2)
    ledger.record(0, 2, 1, 0, 10, [DICT_FILE], {"step": 1}, [])
    ledger.record(0, 2, 2, 0, 10, ["shard_0.pt"], {"step": 2}, [])
    assert ledger.resume_plan({10}) is None
    assert [i for i, _ in ledger.close(0)] == [1, 2]
    assert ledger.resume_plan({10}).index == 1


def _counting_trainer(run_dirs: dict, fault: dict, persist_every: int | None) -> et.TorchTrainer:
    """These tests are of the live parts a re-entered loop resumes from: every recovery re-enters it
    (`recover_in_place=False`; a loop going on in place resumes from nothing: tests/test_in_place.py)."""
    config = {"log_dir": run_dirs["log_dir"], "samples": 48, "epochs": 3, "global_batch_size": 8, "step_time": 0.1,
              "fault": fault}
    return et.TorchTrainer(
        sample_counting_loop, train_loop_config=config,
        scaling_config=et.ScalingConfig(num_workers=(1, 2)),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name="run",
                                checkpoint_config=et.CheckpointConfig(store_every_n_reports=persist_every),
                                elastic_config=et.ElasticConfig(recover_in_place=False)),
    )


def _check_counting_run(result: et.Result, run_dirs: dict) -> list[dict]:
    """The run finished with every sample counted once per epoch and no step run twice; returns the
    generations opened after the fault."""
    assert result.error is None, result.error
    assert result.metrics == {"step": 18, "epoch": 2}
    assert result.checkpoint.to_dict()["counts"].tolist() == [3.0] * 48, "a sample was skipped or repeated"
    rank0 = [p["step"] for p in read_progress(run_dirs["log_dir"]) if p.get("rank") == 0 and "step" in p]
    assert sorted(rank0) == list(range(1, 19)), Counter(rank0)  # every step once: none redone
    assert [h["step"] for h in result.metrics_history] == list(range(1, 19))
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    return [e for e in result.events if e["kind"] == "generation" and e["time"] > fault["time"]]


@pytest.mark.timeout(30)
def test_a_dict_checkpoint_every_rank_holds_is_not_copied_to_a_peer():
    """Every rank reporting its state as a dict holds all of it: a copy on the buddy would double each
    rank's memory for nothing. Rank 0 alone reporting it, or any directory part, is copied."""
    assert not needs_replica([DICT_FILE], every_rank_holds_one=True)
    assert not needs_replica([DICT_FILE, METADATA_FILE], every_rank_holds_one=True)
    assert needs_replica([DICT_FILE], every_rank_holds_one=False)  # rank 0's alone: its loss would lose it
    assert needs_replica(["model.pt"], every_rank_holds_one=True)  # a directory: its files may differ by rank
    assert needs_replica([DICT_FILE, "shard_0.pt"], every_rank_holds_one=True)


@pytest.mark.timeout(30)
def test_a_live_part_every_rank_holds_is_stored_without_a_round_trip():
    """Every rank holding its live dict part: rank 0's is all of it, so the ranks store it (rank 0
    uploads) without asking the supervisor. A checkpoint the supervisor decides on, or a due live part
    some rank lacks (it names who uploads), takes the round trip."""
    def agreed(checkpoint=False, every_part=True, store_live=False):
        return Agreed(checkpoint=checkpoint, unwind=False, every_part=every_part, store_live=store_live)

    assert not agreed(store_live=True).round_trip  # every rank's live part, due: rank 0 stores it
    assert not agreed(store_live=False).round_trip  # not due: recorded in the background
    assert agreed(every_part=False, store_live=True).round_trip  # rank 0 alone reports its live state
    assert not agreed(every_part=False, store_live=False).round_trip
    assert agreed(checkpoint=True).round_trip  # a folder, a SYNC dict, a named live part
    assert agreed(checkpoint=True, store_live=True).round_trip


def _state_every_step_loop(config: dict) -> None:
    for step in range(1, config["steps"] + 1):
        et.report({"step": step}, checkpoint=et.Checkpoint.from_dict({"step": step}))


@pytest.mark.timeout(120)
def test_every_rank_reporting_its_state_stores_the_due_ones_and_the_last(local_ray, run_dirs):
    """Every rank reports its state each step, every 2nd stored: rank 0 stores the due ones with no round
    trip to the supervisor, and the loop's last one when it ends; no other (a dict holding no tensor
    never goes stale, so one not stored must not be uploaded later). Under a cadence an upload still
    waiting may be replaced by a newer one: 4 may give way to the last, 5."""
    for steps, stored in ((4, {2, 4}), (5, {2, 4, 5})):
        result = et.TorchTrainer(
            _state_every_step_loop, train_loop_config={"steps": steps},
            scaling_config=et.ScalingConfig(num_workers=2),
            run_config=et.RunConfig(storage_path=run_dirs["storage"], name=f"run_{steps}",
                                    checkpoint_config=et.CheckpointConfig(store_every_n_reports=2)),
        ).fit()
        assert result.error is None, result.error
        indices = [c.index for c in list_checkpoints(result.path)]
        assert indices[-1] == steps and set(indices) <= stored, indices
        assert result.checkpoint.to_dict() == {"step": steps}


@pytest.mark.timeout(180)
def test_a_peer_lost_after_the_steps_all_reduce_costs_no_step(local_ray, run_dirs):
    """Rank 1 dies after its share of step 7 is all-reduced, before its report: rank 0's report 7
    barrier fails, but its live state holds all of step 7 (and its last report's no longer does).
    The run goes on from step 7, held in memory and stored later (every report is stored by default)."""
    fault = {"kind": "kill", "rank": 1, "at_step": 7, "point": "before_report"}
    result = _counting_trainer(run_dirs, fault, persist_every=None).fit()
    after = _check_counting_run(result, run_dirs)
    assert (after[0]["resume_from"], after[0]["resume_index"], after[0]["world_size"]) == ("memory", 7, 1)
    assert [e["index"] for e in result.events if e["kind"] == "report_unagreed_kept"] == [7]
    committed = [c.index for c in list_checkpoints(result.path)]
    assert committed == list(range(1, 19)), committed  # report 7 too: its holder stored it
    assert verify_checkpoint(result.path, 7) == []


@pytest.mark.timeout(180)
def test_live_parts_between_stored_checkpoints_serve_the_recovery(local_ray, run_dirs):
    """With a cadence, the reports in between are never serialized; a peer lost mid-step leaves the
    survivor's last live part clean, and the run goes on from it."""
    fault = {"kind": "kill", "rank": 1, "at_step": 7}
    result = _counting_trainer(run_dirs, fault, persist_every=5).fit()
    after = _check_counting_run(result, run_dirs)
    assert (after[0]["resume_from"], after[0]["resume_index"]) == ("memory", 6)
    assert not [e for e in result.events if e["kind"] == "report_unagreed_kept"]
    assert [c.index for c in list_checkpoints(result.path)][-1] == 18  # the last one is stored when the loop ends
