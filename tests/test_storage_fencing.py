"""Storage writes are fenced by generation: each generation's attempt at a checkpoint has a folder of
its own, so a stale writer (a fenced worker, a store queue still busy after its generation ended) can
never change a checkpoint another generation commits; a commit checks the stored sizes against what
the writers reported; a folder whose commit is under way is never swept, and one that a live rank
still uploads into is not removed by retention. Storage, store queue and ledger are tested without
Ray; the commit path (supervisor/checkpoints/commits.py) without the supervisor actor; shutdown on real Ray."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import s3fs

import elastic_train as et
from chaos.storage_proxy import FaultyStorageProxy, StorageFaults
from elastic_train.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint
from elastic_train.checkpoint.layout import Attempt
from elastic_train.checkpoint.manifest import MANIFEST, Manifest, file_facts
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.checkpoint.storage import CommitRefused, RunStorage
from elastic_train.protocol import Assignment, ResumePlan
from elastic_train.supervisor.checkpoints.commits import Commits
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry
from elastic_train.worker.store.queue import PartObsolete, PartToStore, StoreQueue, obsolete
from tests.loops import sharded_directory_loop

WAIT_S = 10.0  # how long a test waits for a thread it started to reach a point
FAST_RETRY = RetryPolicy(initial_s=0.01, max_s=0.05, deadline_s=5.0)


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> RunStorage:
    """A run's storage on the local disk, and on a real S3 endpoint (moto's server)."""
    if request.param == "local":
        return RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    bucket = request.getfixturevalue("s3_bucket")
    return RunStorage(bucket["url"], "run", bucket["options"], retry=FAST_RETRY)


def _manifest(index: int, generation: int, facts: dict[str, dict[str, Any]], **metrics: float) -> Manifest:
    return Manifest(step=index, generation=generation, world_size=1, files=facts, metrics=dict(metrics))


# -- storage --------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_stale_generation_writes_its_own_folder_and_never_changes_a_commit(storage):
    """After a rewind generation 1 reports index 4 again, while a worker of generation 0 still
    uploads its part of index 4: it lands in generation 0's folder, never in the committed one."""
    storage.write_part(4, {"model.pt": b"old state"}, generation=0)
    facts = storage.write_part(4, {"model.pt": b"the new generation's state"}, generation=1)
    committed = storage.commit(4, _manifest(4, 1, facts))
    storage.write_part(4, {"model.pt": b"a stale writer, late"}, generation=0)
    assert committed.path.endswith("/run/checkpoint_000004_g0001")
    assert storage.attempts() == [Attempt(4, 0), Attempt(4, 1)]
    assert storage.committed() == [committed]
    assert storage.verify(committed) == []
    assert storage.read_verified(committed) == {"model.pt": b"the new generation's state"}
    run = storage.url()
    assert verify_checkpoint(run, 4, storage.storage_options) == []
    assert load_checkpoint(run, storage_options=storage.storage_options).files() == {
        "model.pt": b"the new generation's state"}
    # The stale folder holds no commit: the sweep removes it, the committed one stays.
    assert storage.sweep(lambda attempt: attempt == committed.attempt) == [Attempt(4, 0)]
    assert storage.attempts() == [Attempt(4, 1)]


@pytest.mark.timeout(60)
def test_a_commit_is_refused_when_the_stored_files_do_not_match_what_their_writers_reported(storage):
    facts = storage.write_part(2, {"shard_0": b"0" * 10}, generation=3)
    missing = {**facts, "shard_1": {"size": 7, "xxh3_128": "0" * 32}}  # its writer's upload never landed
    with pytest.raises(CommitRefused, match="shard_1 is not stored"):
        storage.commit(2, _manifest(2, 3, missing))
    other = file_facts({"shard_0": b"0" * 12})  # another writer's file under this name
    with pytest.raises(CommitRefused, match="shard_0 is stored with 10 bytes, its writer reported 12"):
        storage.commit(2, _manifest(2, 3, other))
    assert storage.committed() == []  # no manifest was written over files that do not match it
    assert [c.attempt for c in [storage.commit(2, _manifest(2, 3, facts))]] == storage.attempts() == [Attempt(2, 3)]


@pytest.mark.timeout(30)
def test_folder_names_are_readable_sorted_and_a_folder_named_by_index_alone_still_loads(tmp_path):
    assert Attempt(2, 0).dirname == "checkpoint_000002_g0000"
    assert Attempt.parse("checkpoint_000012_g0003") == Attempt(12, 3)
    assert Attempt.parse("checkpoint_000012") == Attempt(12, -1)
    assert Attempt.parse("events.json") is None
    names = [Attempt(i, g).dirname for i, g in ((10, 0), (2, 1), (2, 0), (9, 12))]
    assert sorted(names) == [a.dirname for a in sorted(Attempt.parse(n) for n in names)]
    # A run stored before folders had a generation resumes from it.
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    legacy = os.path.join(storage.root, "checkpoint_000003")
    os.makedirs(legacy)
    with open(os.path.join(legacy, "a.bin"), "wb") as f:
        f.write(b"legacy")
    with open(os.path.join(legacy, MANIFEST), "w") as f:
        f.write(_manifest(3, 0, file_facts({"a.bin": b"legacy"})).to_json())
    assert [(c.index, c.generation) for c in list_checkpoints(storage.url())] == [(3, -1)]
    assert load_checkpoint(storage.url()).files() == {"a.bin": b"legacy"}


@pytest.mark.timeout(60)
def test_a_folder_whose_commit_is_under_way_is_never_swept_and_one_being_removed_is_never_committed(
    tmp_path, monkeypatch
):
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    facts = storage.write_part(4, {"a.bin": b"a" * 8}, generation=1)
    listing, go_on = threading.Event(), threading.Event()
    real_sizes = storage._stored_sizes

    def slow_listing(attempt: Attempt) -> dict[str, int]:
        listing.set()
        assert go_on.wait(WAIT_S)
        return real_sizes(attempt)

    monkeypatch.setattr(storage, "_stored_sizes", slow_listing)
    with ThreadPoolExecutor(2) as pool:
        commit = pool.submit(storage.commit, 4, _manifest(4, 1, facts))
        assert listing.wait(WAIT_S)
        assert storage.sweep(lambda attempt: False) == []  # the commit is under way: its folder stays
        assert not storage.wait_for_commits(0.0)
        go_on.set()
        committed = commit.result(WAIT_S)
        assert storage.wait_for_commits(WAIT_S)
        assert storage.committed() == [committed] and storage.verify(committed) == []

        five = storage.write_part(5, {"b.bin": b"b"}, generation=1)
        claimed, release = threading.Event(), threading.Event()

        def keep_after_a_while(attempt: Attempt) -> bool:
            claimed.set()
            assert release.wait(WAIT_S)
            return False

        removal = pool.submit(storage.delete, Attempt(5, 1), keep_after_a_while)
        assert claimed.wait(WAIT_S)
        with pytest.raises(CommitRefused, match="being removed"):
            storage.commit(5, _manifest(5, 1, five))
        release.set()
        assert removal.result(WAIT_S) is True
    assert storage.attempts() == [Attempt(4, 1)]


@pytest.mark.timeout(30)
def test_a_local_write_into_a_folder_removed_meanwhile_recreates_it_instead_of_failing(tmp_path, monkeypatch):
    """As in an object store: a removal under a slow writer (retention, a sweep) must not fail the run
    with a FileNotFoundError on that writer's worker."""
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    real_replace, removed = os.replace, []

    def replace_after_a_removal(src: str, dst: str) -> None:
        if not removed:
            removed.append(os.path.dirname(dst))
            shutil.rmtree(os.path.dirname(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_a_removal)
    facts = storage.write_part(7, {"a.bin": b"whole"}, generation=0)
    assert removed == [storage.folder(Attempt(7, 0))]
    with open(os.path.join(storage.folder(Attempt(7, 0)), "a.bin"), "rb") as f:
        assert f.read() == b"whole"
    assert storage.commit(7, _manifest(7, 0, facts)).attempt == Attempt(7, 0)
    assert sorted(os.listdir(storage.folder(Attempt(7, 0)))) == ["a.bin", MANIFEST]  # no scratch file left


# -- the worker's store queue -------------------------------------------------------------------------
def _assignment(generation: int, resumed_at: int | None) -> Assignment:
    return Assignment(generation=generation, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      master_addr="127.0.0.1", master_port=0,
                      resume=ResumePlan(resumed_at) if resumed_at is not None else None, peers={})


@pytest.mark.timeout(30)
def test_the_persister_drops_parts_that_a_newer_generation_reports_again_before_their_upload():
    place = [_assignment(0, None)]
    first_started, go_on = threading.Event(), threading.Event()
    uploaded: list[tuple[int, int]] = []
    given_up: list[PartToStore] = []
    failed: list[PartToStore] = []

    def upload(part: PartToStore) -> None:  # as TrainWorker._upload does
        if (part.generation, part.index) == (0, 3):
            first_started.set()
            assert go_on.wait(WAIT_S)
        if obsolete(part, place[0]):
            raise PartObsolete("reported again by a newer generation")
        uploaded.append((part.generation, part.index))

    queue = StoreQueue(upload, lambda p, e: given_up.append(p), lambda p, e: failed.append(p),
                       max_queued=8)
    queue.submit(PartToStore(0, 3, {"a": b"3"}, replaceable=False))
    assert first_started.wait(WAIT_S)
    for index in (4, 5):  # queued behind the upload of 3 (checkpoints kept by score: all of them)
        queue.submit(PartToStore(0, index, {"a": b"x"}, replaceable=False))
    place[0] = _assignment(1, resumed_at=4)  # generation 1 resumes at 4 and reports 5 again
    queue.submit(PartToStore(1, 5, {"a": b"5"}, replaceable=False))
    queue.submit(PartToStore(0, 6, {"a": b"6"}, replaceable=False, final=True))  # a failed run's Stop.flush
    go_on.set()
    assert queue.flush(WAIT_S)
    queue.close(WAIT_S)
    # 4 may still commit (the supervisor kept it: 4 <= the resume index); 5 of generation 0 never can.
    assert uploaded == [(0, 3), (0, 4), (1, 5), (0, 6)]
    assert given_up == [] and failed == []
    assert not obsolete(PartToStore(2, 9, {}), _assignment(2, resumed_at=0))  # the current generation's own
    assert obsolete(PartToStore(1, 1, {}), _assignment(2, resumed_at=None))  # the newer one started afresh


# -- the supervisor's ledger and commits --------------------------------------------------------------
def _report(ledger: CheckpointLedger, generation: int, index: int, parts: dict[int, list[str]],
            **metrics: float) -> None:
    """Every rank reports checkpoint `index`; `parts`: worker id (rank = its position) -> file names."""
    for rank, (worker_id, names) in enumerate(parts.items()):
        reported = dict(metrics) if rank == 0 else None
        entry = ledger.record(generation, len(parts), index, rank, worker_id, names, reported, [])
        entry.to_store = True


@pytest.mark.timeout(10)
def test_a_part_of_an_older_generation_never_counts_for_an_index_reported_again():
    ledger = CheckpointLedger(keep=2)
    _report(ledger, 0, 2, {10: ["shard_0"], 11: ["shard_1"]})
    ledger.rewind(1)
    _report(ledger, 1, 2, {10: ["shard_0"], 11: ["shard_1"]})
    stale = file_facts({"shard_1": b"generation 0"})
    assert ledger.mark_stored(2, 11, stale, generation=0) is None
    entry = ledger.mark_stored(2, 10, file_facts({"shard_0": b"generation 1"}), generation=1)
    assert entry is not None and not entry.ready_to_commit and entry.stored.keys() == {10}
    # A folder that a live rank may still upload into is given up at once, removed only once it is done.
    _report(ledger, 1, 3, {10: ["shard_0"], 11: ["shard_1"]})
    assert ledger.abandoned_before(3, live_workers={10, 11}) == []
    assert entry.given_up and not entry.ready_to_commit
    assert ledger.abandoned_before(3, live_workers={10}) == [(2, 1, None)]  # worker 11 is gone
    assert ledger.abandoned_before(3, live_workers={10}) == []  # returned once


class _Host:
    """What a commit tells the run, without the supervisor: the live workers are given."""

    def __init__(self, workers: list[int]):
        self._workers = set(workers)

    def settle(self, generation: int, index: int, committed: Any) -> None:
        pass

    def fail_now(self, message: str) -> None:
        raise AssertionError(f"the run failed: {message}")

    def live_workers(self) -> set[int]:
        return self._workers


class _Commits(Commits):
    """The supervisor's commit path without its Ray actor."""

    def __init__(self, storage: RunStorage, checkpointing: et.CheckpointConfig, workers: list[int]):
        self.ledger, self.tasks = CheckpointLedger(keep=2), Tasks()
        super().__init__(storage, checkpointing, self.ledger, _Host(workers), Telemetry([], time.monotonic()),
                         self.tasks)


async def _store(commits: _Commits, worker_id: int, generation: int, index: int, files: dict[str, bytes]) -> None:
    """What a worker's store queue does with its part: write it, tell the supervisor, wait for any commit."""
    facts = commits._storage.write_part(index, files, generation=generation)
    commits.part_stored(worker_id, generation, index, facts)
    await commits.tasks.wait(time.monotonic() + 20)


@pytest.mark.timeout(30)
def test_a_stale_part_after_a_rewind_is_never_committed_as_part_of_the_new_generations_checkpoint(tmp_path):
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    commits = _Commits(storage, et.CheckpointConfig(), [10, 11])
    sharded = {10: ["shard_0"], 11: ["shard_1"]}

    async def scenario() -> None:
        _report(commits.ledger, 0, 2, sharded)
        await _store(commits, 10, 0, 2, {"shard_0": b"gen 0, rank 0"})
        commits.ledger.rewind(1)  # generation 1 resumes at 1 and reports 2 again
        _report(commits.ledger, 1, 2, sharded)
        await _store(commits, 11, 0, 2, {"shard_1": b"gen 0, rank 1: stale"})  # a fenced worker, late
        await _store(commits, 10, 1, 2, {"shard_0": b"gen 1, rank 0"})
        assert storage.committed() == []  # rank 1 of generation 1 has not stored its part yet
        await _store(commits, 11, 1, 2, {"shard_1": b"gen 1, rank 1"})

    asyncio.run(scenario())
    [committed] = storage.committed()
    assert committed.attempt == Attempt(2, 1) and commits.committed == [committed]
    assert storage.read_verified(committed) == {"shard_0": b"gen 1, rank 0", "shard_1": b"gen 1, rank 1"}


@pytest.mark.timeout(30)
def test_retention_by_score_keeps_a_folder_that_a_slow_rank_still_uploads_into(tmp_path):
    """Both ranks store `model.pt` (replicated content): rank 0's copy commits checkpoints 2 and 3
    while rank 1 is still uploading its copy of 2. Checkpoint 2, the worst, is a retention victim, but
    its folder is removed only once rank 1 is done with it."""
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    scored = et.CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="loss", checkpoint_score_order="min")
    commits = _Commits(storage, scored, [10, 11])
    both = {10: ["model.pt"], 11: ["model.pt"]}

    def model(index: int) -> dict[str, bytes]:
        return {"model.pt": f"state {index}".encode()}

    async def scenario() -> None:
        for index, loss in ((1, 0.5), (2, 0.9), (3, 0.8), (4, 0.7)):
            _report(commits.ledger, 0, index, both, loss=loss)
        await _store(commits, 10, 0, 1, model(1))
        await _store(commits, 11, 0, 1, model(1))
        await _store(commits, 10, 0, 2, model(2))
        await _store(commits, 10, 0, 3, model(3))
        # Committed: 1 (best), 2, 3 (newest). 2 is a victim, but rank 1 still uploads into its folder.
        assert [c.index for c in storage.committed()] == [1, 2, 3]
        await _store(commits, 11, 0, 2, model(2))
        await _store(commits, 11, 0, 3, model(3))
        await _store(commits, 10, 0, 4, model(4))
        await _store(commits, 11, 0, 4, model(4))

    asyncio.run(scenario())
    assert [c.index for c in commits.committed] == [1, 4]
    assert storage.attempts() == [Attempt(1, 0), Attempt(4, 0)]  # nothing torn left behind
    assert all(storage.verify(c) == [] for c in storage.committed())


@pytest.mark.timeout(30)
def test_a_new_fit_goes_on_from_the_newest_generation_in_storage_and_sweeps_torn_folders(tmp_path):
    """A worker of an earlier fit that is still writing can then never write into a folder this fit
    commits: this fit's generations are all newer."""
    storage = RunStorage(str(tmp_path / "storage"), "run", retry=FAST_RETRY)
    storage.commit(5, _manifest(5, 2, storage.write_part(5, {"a": b"5"}, generation=2)))
    storage.write_part(6, {"a": b"6"}, generation=3)  # torn: the earlier fit died while writing it
    commits = _Commits(storage, et.CheckpointConfig(), [])
    assert commits.recover(sweep=True) == 3  # the next generation opened is 4
    assert storage.attempts() == [Attempt(5, 2)]
    assert [c.attempt for c in commits.committed] == [Attempt(5, 2)]


# -- shutdown, on real Ray ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_last_commit_that_outlasts_the_drain_is_waited_for_and_kept(local_ray, run_dirs, s3_bucket):
    """Every manifest takes longer to store than drain_timeout_s: the run must neither sweep the last
    checkpoint's folder while its commit is under way nor end before it is committed."""
    elastic = et.ElasticConfig(rendezvous_timeout_s=5.0, drain_timeout_s=6.0, process_group_destroy_timeout_s=2.0)
    with FaultyStorageProxy(s3_bucket["endpoint"], seed=3) as proxy:
        proxy.set_faults(StorageFaults(latency_s=2 * elastic.drain_timeout_s, methods=frozenset({"PUT"}),
                                       path_contains=MANIFEST))
        result = et.TorchTrainer(
            sharded_directory_loop,
            train_loop_config={"log_dir": run_dirs["log_dir"], "steps": 4, "step_time": 0.05},
            scaling_config=et.ScalingConfig(num_workers=2),
            run_config=et.RunConfig(storage_path=s3_bucket["url"], name="run", elastic_config=elastic,
                                    storage_options={**s3_bucket["options"], "endpoint_url": proxy.url}),
        ).fit()
        assert proxy.stats["requests"] > 0 and proxy.injected
    assert result.error is None, result.error
    assert result.checkpoint is not None and result.checkpoint.manifest.step == 4
    committed = list_checkpoints(result.path, s3_bucket["options"])
    assert committed[-1].index == 4, [c.index for c in committed]
    assert all(verify_checkpoint(result.path, c.index, s3_bucket["options"]) == [] for c in committed)
    fs = s3fs.S3FileSystem(**s3_bucket["options"])
    folders = [f.rsplit("/", 1)[-1] for f in fs.ls(f"{s3_bucket['url'][5:]}/run", refresh=True) if "checkpoint_" in f]
    assert sorted(folders) == sorted(c.attempt.dirname for c in committed)  # nothing torn left
