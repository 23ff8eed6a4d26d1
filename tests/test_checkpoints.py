"""Checkpoint directories of all ranks merge by name; resume falls back to storage when no
survivor holds a whole checkpoint; a stored run resumes with a new fit()."""

from __future__ import annotations

import os
import threading

import pytest

import elastic_train as et
from elastic_train.checkpoint import manifest
from elastic_train.checkpoint.layout import Attempt
from elastic_train.checkpoint.manifest import CorruptCheckpointError, facts_made, facts_soon, file_facts
from elastic_train.checkpoint.storage import CHECKED_WHILE_WRITTEN_BYTES, RunStorage
from elastic_train.protocol import HeldCheckpoint, ResumePlan
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.worker.hold.parts import HeldParts
from tests.helpers import make_trainer
from tests.loops import linear_regression_loop, read_progress, sharded_directory_loop


@pytest.mark.timeout(10)
def test_ledger_serves_replicated_files_from_any_survivor_and_sharded_ones_only_whole():
    ledger = CheckpointLedger(keep=2)
    for index in (1, 2):
        ledger.record(0, 2, index, 0, worker_id=10, names=["model.pt", "shard_0"], metrics={"i": index},
                      loader_states=[])
        ledger.record(0, 2, index, 1, worker_id=11, names=["model.pt", "shard_1"], metrics=None, loader_states=[])
    ledger.record(0, 2, 3, 0, worker_id=10, names=["model.pt", "shard_0"], metrics={}, loader_states=[])
    # Index 3 is incomplete (rank 1 never reported it): the newest whole one is 2.
    assert ledger.resume_plan({10, 11}) == ResumePlan(2, {10: ["model.pt", "shard_0"], 11: ["shard_1"]}, generation=0)
    # Without worker 11, shard_1 is held by nobody: no checkpoint can be served from memory.
    assert ledger.resume_plan({10}) is None
    # Once worker 10 keeps a replica of worker 11's part of index 2, it serves index 2 whole alone.
    ledger.record_replica(0, 2, 10, ["model.pt", "shard_1"])
    assert ledger.resume_plan({10}) == ResumePlan(2, {10: ["model.pt", "shard_0", "shard_1"]}, generation=0)
    ledger.rewind(1)
    assert sorted(ledger.entries) == [1]


@pytest.mark.timeout(10)
def test_a_checkpoint_whose_uploader_was_lost_before_it_told_its_part_stored_is_stored_by_its_holders():
    """Rank 1's worker stored its part, but its notice died with it (the report stream sends it after
    the upload): the checkpoint would never commit. The survivors that hold it in memory store it;
    not while worker 11 lives (its notice is on its way), nor once it told, nor when it is committed."""
    ledger = CheckpointLedger(keep=2)
    for rank, worker in ((0, 10), (1, 11)):
        ledger.record(0, 2, 4, rank, worker_id=worker, names=[f"shard_{rank}"], metrics={}, loader_states=[])
    entry = ledger.entries[4]
    entry.to_store = True
    ledger.record_replica(0, 4, 10, ["shard_1"])
    ledger.mark_stored(4, 10, {"shard_0": {}}, 0)
    assert not ledger.resume_plan({10, 11}).store  # worker 11 is alive: its notice may still come
    assert not ledger.resume_plan({10}, alive={10, 11}).store  # ... though it does not serve the next generation
    plan = ledger.resume_plan({10})
    assert plan.index == 4 and plan.holders == {10: ["shard_0", "shard_1"]} and plan.store
    ledger.mark_stored(4, 11, {"shard_1": {}}, 0)
    assert not ledger.resume_plan({10}).store  # it told before it went
    del entry.stored[11]
    # Worker 10 stores it again: until it tells, its folder is not removed (a newer checkpoint committed).
    ledger.restoring(plan)
    assert entry.unstored() == {10, 11} and not entry.stored
    ledger.record(0, 2, 5, 0, worker_id=10, names=["shard_0"], metrics={}, loader_states=[])
    assert ledger.abandoned_before(5, {10}) == [] and not entry.given_up
    ledger.mark_stored(4, 10, {"shard_0": {}, "shard_1": {}}, 0)
    assert entry.ready_to_commit
    entry.committed = True
    assert not ledger.resume_plan({10}).store


@pytest.mark.timeout(10)
def test_a_resume_plan_carries_each_served_copys_facts_and_a_copy_found_corrupt_is_never_planned_again():
    """Each file is checked where it lands against the facts its copy was made with: the reporter's
    own, a replica's (its reporter's), a live part's (made as it was serialized, told as its holder
    parks). A copy found corrupt is passed over: the next holder serves, or no plan from memory."""
    own_0, own_1 = file_facts({"shard_0": b"zero"}), file_facts({"shard_1": b"one"})
    ledger = CheckpointLedger(keep=2)
    ledger.record(0, 2, 4, 0, worker_id=10, names=["shard_0"], metrics={}, loader_states=[])
    ledger.record(0, 2, 4, 1, worker_id=11, names=["shard_1"], metrics={}, loader_states=[])
    ledger.record_replica(0, 4, 11, ["shard_0"], facts=own_0)  # worker 11 keeps worker 10's part
    # The reporters tell the facts of their own copies as they park (before any plan is made from them).
    ledger.note_held(10, [HeldCheckpoint(4, 0, 0, ["shard_0"], [], own_0)])
    ledger.note_held(11, [HeldCheckpoint(4, 0, 1, ["shard_1"], [], own_1)])
    assert ledger.resume_plan({10, 11}).facts == {**own_0, **own_1}
    assert ledger.mark_corrupt(0, 4, 10, "shard_0") and not ledger.mark_corrupt(0, 4, 10, "shard_0")
    plan = ledger.resume_plan({10, 11})
    assert plan.holders == {11: ["shard_0", "shard_1"]} and plan.facts == {**own_0, **own_1}
    ledger.mark_corrupt(0, 4, 11, "shard_0")
    assert ledger.resume_plan({10, 11}) is None
    # Facts of a report the ledger does not know (another generation's, say) are no one's.
    ledger.note_held(10, [HeldCheckpoint(4, 1, 0, ["shard_0"], [], own_1), HeldCheckpoint(9, 0, 0, ["x"], [])])
    assert ledger.entries[4].copies[10] == own_0 and 9 not in ledger.entries


@pytest.mark.timeout(10)
def test_a_checkpoint_whose_lost_rank_died_with_its_report_is_whole_if_its_barrier_says_that_rank_held_no_part():
    """Rank 0 alone reports a folder; rank 1's report of it died with rank 1 (reports without a part
    are sent in batches). Rank 0's report says, from the barrier's all-reduce, that only rank 0 held
    a part: once the generation closes, the checkpoint is whole and resumed from. Had rank 1 held a
    part too, it is not: its files are unknown."""
    for holders, whole in (([0], True), ([0, 1], False)):
        ledger = CheckpointLedger(2)
        entry = ledger.record(0, 2, 6, 0, 10, ["checkpoint.pt"], {"step": 6}, [])
        entry.part_ranks = set(holders)
        assert not entry.whole  # rank 1's report may still come
        ledger.close(0)
        assert entry.whole is whole
        assert (ledger.resume_plan({10}) is not None) is whole


@pytest.mark.timeout(10)
def test_held_parts_have_their_facts_made_in_the_background_as_they_were_reported():
    memory = HeldParts(keep=2)
    files = {"model.pt": b"weights"}
    memory.put(HeldCheckpoint(1, 0, 0, ["model.pt"], []), files)
    replica = file_facts({"shard_1": b"peer"})
    memory.put(HeldCheckpoint(2, 0, 1, ["shard_1"], [], replica), {"shard_1": b"peer"})  # a peer's, with its facts
    assert memory.facts(0, 1) == file_facts(files) and memory.facts(0, 2) == replica
    assert [h.facts for h in memory.holdings()] == [file_facts(files), replica]
    memory.put(HeldCheckpoint(3, 0, 0, ["model.pt"], []), files)  # evicts index 1
    assert memory.facts(0, 1) == {} and memory.keys() == [(0, 2), (0, 3)]


@pytest.mark.timeout(10)
def test_an_evicted_part_cancels_the_making_of_its_facts_and_whoever_shares_them_makes_them_itself():
    """The hashing thread is one: were the loop to report faster than it hashes, the parts waiting
    for it would pile up. A part the memory evicts before its turn is hashed never, except by who
    still needs its facts (the store queue, the replicator), on their own thread. (A part of up to
    HASHED_AT_ONCE_BYTES is hashed at once: the next test.)"""
    hashing_busy, release = threading.Event(), threading.Event()
    blocker = manifest._HASHING.submit(lambda: (hashing_busy.set(), release.wait(5)))
    assert hashing_busy.wait(5)
    try:
        memory = HeldParts(keep=1)
        parts = [{"model.pt": bytes([index]) * (manifest.HASHED_AT_ONCE_BYTES + 1)} for index in range(3)]
        shared = [facts_soon(part) for part in parts]  # what the store queue and replicator hold too
        for index, (part, facts) in enumerate(zip(parts, shared)):
            memory.put(HeldCheckpoint(index, 0, 0, ["model.pt"], []), part, facts=facts)
        assert [f.cancelled() for f in shared] == [True, True, False] and memory.keys() == [(0, 2)]
        assert facts_made(parts[0], shared[0]) == file_facts(parts[0])  # made now, by whoever asks
    finally:
        release.set()
    blocker.result(5)
    assert memory.facts(0, 2) == file_facts(parts[2]) and facts_made({}, None) is None


@pytest.mark.timeout(10)
def test_a_small_part_is_hashed_at_once_a_large_one_in_the_background():
    """Up to HASHED_AT_ONCE_BYTES in all, hashing (~40 us) costs less than handing the part to the
    hashing thread; and a part that goes to its buddy inside the report needs its facts then."""
    hashing_busy, release = threading.Event(), threading.Event()
    blocker = manifest._HASHING.submit(lambda: (hashing_busy.set(), release.wait(5)))
    assert hashing_busy.wait(5)
    try:
        small = {"a.pt": b"x" * (manifest.HASHED_AT_ONCE_BYTES // 2), "b.pt": b"y" * (manifest.HASHED_AT_ONCE_BYTES // 2)}
        large = {**small, "c.pt": b"z"}
        assert facts_soon(small).result(timeout=0) == file_facts(small)  # made while the hashing thread is busy
        pending = facts_soon(large)
        assert not pending.done()
    finally:
        release.set()
    blocker.result(5)
    assert pending.result(5) == file_facts(large)


@pytest.mark.timeout(10)
def test_a_part_whose_held_copy_no_longer_matches_its_report_is_not_stored(tmp_path):
    storage = RunStorage.at(str(tmp_path / "run"))
    files = {"model.pt": b"weights", "extra.txt": b"note"}
    facts = file_facts(files)
    assert storage.write_part(1, files, facts=facts) == facts
    with pytest.raises(CorruptCheckpointError, match=r"model.pt does not match its checksum \(xxh3_128\) in its report"):
        storage.write_part(2, {**files, "model.pt": b"weighTs"}, facts=facts)
    assert not any(a.index == 2 for a in storage.attempts())
    # A large part is checked while it is written: what was written of a corrupt copy is removed.
    big = {"model.pt": bytes(CHECKED_WHILE_WRITTEN_BYTES), "extra.txt": b"note"}
    big_facts = file_facts(big)
    assert storage.write_part(3, big, facts=big_facts) == big_facts
    with pytest.raises(CorruptCheckpointError, match=r"model.pt does not match its checksum \(xxh3_128\) in its report"):
        storage.write_part(4, {**big, "model.pt": b"\1" + bytes(CHECKED_WHILE_WRITTEN_BYTES - 1)}, facts=big_facts)
    assert storage.fs.find(storage.folder(Attempt(4, 0))) == []


@pytest.mark.timeout(10)
def test_resume_plans_use_what_parked_workers_hold_and_memory_is_keyed_by_generation():
    """After a rewind a new generation reports the same indices again: a part of an older generation
    must never be served for a newer one. And a worker that evicted a snapshot is no holder of it."""
    old = HeldCheckpoint(5, 1, 0, ["model.pt"], [])  # this worker, as rank 0 of generation 1
    new = HeldCheckpoint(5, 2, 0, ["model.pt"], [])  # its peer, rank 0 of generation 2 (a replica)
    own, replicas = HeldParts(keep=2), HeldParts(keep=2)
    own.put(old, {"model.pt": b"generation 1"})
    replicas.put(new, {"model.pt": b"generation 2"})
    assert own.find(2, 5, ["model.pt"]) == {} and replicas.get(2, 5, ["model.pt"]) == {"model.pt": b"generation 2"}
    with pytest.raises(KeyError, match="checkpoint 5 of generation 1"):
        replicas.get(1, 5, ["model.pt"])
    # Out of a generation nothing is evicted (what a parked worker said it holds stays true).
    for index in (6, 7):
        replicas.put(HeldCheckpoint(index, 3, 0, ["model.pt"], []), {"model.pt": b""}, evict=False)
    assert replicas.keys() == [(2, 5), (3, 6), (3, 7)]

    ledger = CheckpointLedger(keep=2)
    for index in (1, 2, 3):
        for rank, worker in ((0, 10), (1, 11)):
            ledger.record(0, 2, index, rank, worker_id=worker, names=[f"shard_{rank}"], metrics=None, loader_states=[])
    assert ledger.resume_plan({10, 11}).index == 3
    # Worker 11 parked saying it holds only 1 and 2 (it evicted 3, say): 3 cannot be served whole.
    assert ledger.resume_plan({10, 11}, holds={11: {(0, 1, "shard_1"), (0, 2, "shard_1")}}).index == 2
    assert ledger.resume_plan({10, 11}, holds={11: set()}) is None
    # It holds checkpoint 2, but only a peer's file of it (its own evicted): 2 is not served by it.
    assert ledger.resume_plan({10, 11}, holds={11: {(0, 1, "shard_1"), (0, 2, "shard_0")}}).index == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replicate", [False, True])
def test_rank_directories_merge_and_a_lost_shard_falls_back_to_storage(local_ray, run_dirs, replicate):
    """Rank 1's shard dies with it: without replicas the survivor resumes from a whole checkpoint in
    storage; with them (the default), from rank 1's replica in rank 0's memory. Never a torn one. (The
    loop would go on in place, its survivor keeping its rank: `recover_in_place=False` makes it
    re-enter, the path where the shard must be found.)"""
    result = make_trainer(run_dirs, (1, 2), sharded_directory_loop, steps=90, step_time=0.1,  # time for the replacement
                          elastic=et.ElasticConfig(replicate_checkpoints=replicate, recover_in_place=False),
                          fault={"kind": "kill", "rank": 1, "at_step": 12}).fit()
    assert result.error is None, result.error
    assert result.world_sizes[-1] == 2
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["common.txt", "shard_0.txt", "shard_1.txt"]
    restored = [p for p in read_progress(run_dirs["log_dir"]) if "restored" in p]
    assert restored, "the loop never resumed"
    after_kill = restored[0]
    # Every shard present, all of one step.
    assert after_kill["restored"] == ["common.txt", "shard_0.txt", "shard_1.txt"]
    assert len(after_kill["restored_steps"]) == 1
    resumed = [e for e in result.events if e["kind"] == "generation" and e["generation"] == 1][0]
    assert resumed["resume_from"] == ("memory" if replicate else "storage")


@pytest.mark.timeout(120)
def test_a_new_fit_with_the_same_name_resumes_from_storage(local_ray, run_dirs):
    assert make_trainer(run_dirs, 2, steps=10).fit().metrics["step"] == 10
    second = make_trainer(run_dirs, 2, steps=15).fit()
    assert second.error is None
    assert [h["step"] for h in second.metrics_history] == [11, 12, 13, 14, 15]
    restored = et.TorchTrainer.restore(second.path, linear_regression_loop,
                                       train_loop_config={"steps": 17, "log_dir": run_dirs["log_dir"]},
                                       scaling_config=et.ScalingConfig(num_workers=1)).fit()
    assert [h["step"] for h in restored.metrics_history] == [16, 17]


@pytest.mark.timeout(10)
def test_persist_cadence_all_by_default_every_n_one_in_flight_and_all_by_score():
    from elastic_train.supervisor.checkpoints.cadence import StoreCadence

    every = StoreCadence(et.CheckpointConfig(), now=0.0)
    # No cadence asked for (the default, Ray's contract): every checkpoint, in order, none replaced.
    assert all(every.choose(i, now=0.0) for i in range(1, 6)) and not every.replaceable
    newest = StoreCadence(et.CheckpointConfig(store_every_n_reports=2), now=0.0)
    # Every 2nd report, but not while the chosen one (2) is still on its way; once it settles, the next report.
    assert [newest.choose(i, now=i) for i in (1, 2, 3, 4)] == [False, True, False, False]
    newest.settled(2)
    assert [newest.choose(i, now=i) for i in (5, 6, 7)] == [True, False, False]
    scored = StoreCadence(et.CheckpointConfig(store_every_n_reports=2, checkpoint_score_attribute="loss"), 0.0)
    # Kept by score: nothing skipped for an upload in flight, and still every 2nd report.
    assert [i for i in range(1, 9) if scored.choose(i, now=i)] == [2, 4, 6, 8]
    timed = StoreCadence(et.CheckpointConfig(store_every_n_reports=None, store_interval_s=10.0), 0.0)
    chosen = []
    for t in (1, 5, 11, 12, 25):
        if timed.choose(t, now=t):
            chosen.append(t)
            timed.settled(t)
    assert chosen == [11, 25]


@pytest.mark.timeout(10)
def test_parts_of_one_checkpoint_handed_over_by_two_peers_are_merged():
    """Two leaving workers hand their parts of the same checkpoint to one staying worker: it holds both."""
    memory = HeldParts(keep=2)
    memory.put(HeldCheckpoint(4, 1, -1, ["shard_2"], []), {"shard_2": b"2"}, evict=False)
    memory.put(HeldCheckpoint(4, 1, -1, ["shard_3"], []), {"shard_3": b"3"}, evict=False)
    assert memory.get(1, 4, ["shard_2", "shard_3"]) == {"shard_2": b"2", "shard_3": b"3"}
    assert memory.holdings()[0].names == ["shard_2", "shard_3"]
