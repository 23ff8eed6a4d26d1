"""Checkpoints in object storage (a real S3 endpoint: moto's server on 127.0.0.1): a crash never
leaves a torn checkpoint that a later run would restore, a corrupt one is skipped for the previous
whole one, bad storage settings fail before any actor starts."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import ray
import s3fs

import elastic_train as et
from elastic_train.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint
from elastic_train.checkpoint.layout import Attempt
from elastic_train.checkpoint.manifest import MANIFEST, Manifest
from elastic_train.checkpoint.storage import RunStorage
from tests.conftest import ROOT, ray_runtime_env
from tests.helpers import supervisor_alive, wait_for
from tests.loops import large_shard_loop, read_progress, sharded_directory_loop

SHARD_MB = 8


def _folders(fs: s3fs.S3FileSystem, run: str) -> tuple[list[str], list[str]]:
    """Checkpoint folders of a run in the bucket: (committed, torn with some files)."""
    committed, torn = [], []
    try:
        folders = fs.ls(run, refresh=True)
    except FileNotFoundError:
        return [], []
    for folder in folders:
        if "checkpoint_" not in folder:
            continue
        names = [n.rsplit("/", 1)[-1] for n in fs.ls(folder, refresh=True)]
        (committed if MANIFEST in names else torn if names else []).append(folder)
    return sorted(committed), sorted(torn)


@pytest.mark.timeout(300)
def test_driver_killed_while_writing_resumes_from_a_whole_checkpoint(local_ray, run_dirs, s3_bucket):
    fs = s3fs.S3FileSystem(**s3_bucket["options"])
    run = f"{s3_bucket['url'][5:]}/run"
    args = {"address": ray.get_runtime_context().gcs_address, "storage": s3_bucket["url"], "name": "run",
            "workers": 4, "config": {"log_dir": run_dirs["log_dir"], "steps": 10_000, "shard_mb": SHARD_MB}}
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_bucket["endpoint"]}
    driver = subprocess.Popen([sys.executable, "-m", "tests.driver", json.dumps(args)], cwd=ROOT,
                              env={**os.environ, **ray_runtime_env()["env_vars"], **aws})
    try:
        # Kill the driver while a checkpoint is half written, after at least one was committed.
        committed, torn = wait_for(lambda: (f := _folders(fs, run))[0] and f[1] and f, 180,
                                   "a committed checkpoint and a newer one half written")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    last_committed = Attempt.parse(committed[-1].rsplit("/", 1)[-1]).index
    old_pids = {p["pid"] for p in read_progress(run_dirs["log_dir"])}
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in old_pids), 60, "the dead driver's workers to go")
    wait_for(lambda: not supervisor_alive("run"), 60, "the dead driver's supervisor to go")

    result = et.TorchTrainer(
        large_shard_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "steps_after_restore": 2, "shard_mb": SHARD_MB},
        scaling_config=et.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=et.RunConfig(storage_path=s3_bucket["url"], name="run", storage_options=s3_bucket["options"]),
    ).fit()
    assert result.error is None, result.error
    restored = [p for p in read_progress(run_dirs["log_dir"]) if "restored" in p]
    assert {p["world"] for p in restored} == {2}
    for record in restored:
        shards = record["restored"]
        assert sorted(shards) == [f"shard_{r}.bin" for r in range(4)]
        assert {s["size"] for s in shards.values()} == {SHARD_MB * 2**20}, "a shard is not whole"
        steps = {tuple(s["steps"]) for s in shards.values()}
        assert len(steps) == 1 and len(next(iter(steps))) == 1, f"shards of different steps: {shards}"
        assert next(iter(steps))[0] >= last_committed
    # The half-written folders of the crashed run are gone; every commit verifies.
    assert _folders(fs, run)[1] == []
    for checkpoint in list_checkpoints(result.path, s3_bucket["options"]):
        assert verify_checkpoint(result.path, checkpoint.index, s3_bucket["options"]) == []


def _sharded_trainer(run_dirs: dict, s3_bucket: dict, steps: int) -> et.TorchTrainer:
    return et.TorchTrainer(
        sharded_directory_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "steps": steps},
        scaling_config=et.ScalingConfig(num_workers=2),
        run_config=et.RunConfig(storage_path=s3_bucket["url"], name="run", storage_options=s3_bucket["options"]),
    )


@pytest.mark.timeout(180)
def test_a_truncated_shard_hands_the_next_run_the_previous_whole_checkpoint(local_ray, run_dirs, s3_bucket, caplog):
    first = _sharded_trainer(run_dirs, s3_bucket, steps=6).fit()
    assert first.error is None, first.error
    committed = [c.index for c in list_checkpoints(first.path, s3_bucket["options"])]
    assert len(committed) >= 2 and committed[-1] == 6, committed  # the final one is always flushed
    previous = committed[-2]
    fs = s3fs.S3FileSystem(**s3_bucket["options"])
    fs.pipe_file(f"{first.path[5:]}/checkpoint_000006_g0000/shard_1.txt", b"")
    problems = verify_checkpoint(first.path, 6, s3_bucket["options"])
    assert len(problems) == 1 and "shard_1.txt has 0 bytes" in problems[0]
    assert load_checkpoint(first.path, storage_options=s3_bucket["options"]).manifest.step == previous
    assert "checkpoint_000006_g0000/shard_1.txt has 0 bytes" in caplog.text

    second = _sharded_trainer(run_dirs, s3_bucket, steps=9).fit()
    assert second.error is None, second.error
    restored = [p for p in read_progress(run_dirs["log_dir"]) if "restored" in p]
    assert restored and all(p["restored_steps"] == [str(previous)] for p in restored), restored
    corrupt = [e for e in second.events if e["kind"] == "checkpoint_corrupt"]
    assert [e["index"] for e in corrupt] == [6] and "shard_1.txt has 0 bytes" in corrupt[0]["problems"][0]
    assert [h["step"] for h in second.metrics_history] == list(range(previous + 1, 10))
    after = list_checkpoints(first.path, s3_bucket["options"])
    assert after[-1].index == 9 and all(verify_checkpoint(first.path, c.index, s3_bucket["options"]) == []
                                        for c in after)


@pytest.mark.timeout(60)
def test_wrong_credentials_or_a_missing_bucket_fail_before_any_actor_starts(local_ray, run_dirs, s3_bucket):
    def fit(url: str, **options) -> None:
        et.TorchTrainer(sharded_directory_loop, train_loop_config={"log_dir": run_dirs["log_dir"], "steps": 1},
                        run_config=et.RunConfig(storage_path=url, name="run",
                                                storage_options={**s3_bucket["options"], **options})).fit()

    with pytest.raises(et.StorageError, match="NoSuchBucket|does not exist|bucket"):
        fit("s3://no-such-bucket-here")
    with pytest.raises(et.ConfigError, match="memory:// is private to one process"):
        fit("memory://runs")


@pytest.mark.timeout(30)
def test_a_checkpoint_committed_with_sha256_checksums_by_an_earlier_version_still_loads_and_is_still_checked(tmp_path):
    storage = RunStorage(str(tmp_path / "storage"), "run")
    data = {"a.bin": b"x" * 10, "b.bin": b"y" * 3}
    storage.write_part(1, data)
    sha = {name: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for name, d in data.items()}
    committed = storage.commit(1, Manifest(step=1, generation=0, world_size=1, files=sha))
    assert load_checkpoint(storage.url()).files() == data and storage.verify(committed) == []
    storage.fs.pipe_file(f"{storage.folder(Attempt(1, 0))}/b.bin", b"y!y")  # same size, other bytes
    assert storage.verify(committed) == [f"{committed.path}/b.bin does not match its checksum (sha256) in the manifest"]
    other = storage.write_part(2, data)  # what this version writes: XXH3-128
    assert all(set(f) == {"size", "xxh3_128"} for f in other.values())


@pytest.mark.timeout(30)
def test_the_storage_layer_commits_verifies_and_cleans_up_in_any_fsspec_store(tmp_path):
    for url in ("memory://et-test", str(tmp_path / "local")):
        storage = RunStorage(url, "run")
        storage.check_writable()
        facts = storage.write_part(1, {"a.bin": b"x" * 10, "dir/b.bin": b"y"}, generation=0)
        storage.write_part(2, {"a.bin": b"z"}, generation=0)  # never committed: torn
        assert storage.committed() == []
        committed = storage.commit(1, Manifest(step=1, generation=0, world_size=1, files=facts))
        assert [c.index for c in storage.committed()] == [1]
        assert storage.attempts() == [Attempt(1, 0), Attempt(2, 0)]
        assert committed.path.endswith("/run/checkpoint_000001_g0000")
        assert storage.read_verified(committed) == {"a.bin": b"x" * 10, "dir/b.bin": b"y"}
        storage.fs.pipe_file(f"{storage.folder(Attempt(1, 0))}/a.bin", b"x" * 9 + b"!")
        assert storage.verify(committed) == [f"{committed.path}/a.bin does not match its checksum (xxh3_128) in the manifest"]
        assert storage.newest_whole(storage.committed()) == (
            None, [(committed, [f"{committed.path}/a.bin does not match its checksum (xxh3_128) in the manifest"])])
        assert storage.sweep(lambda attempt: attempt == committed.attempt) == [Attempt(2, 0)]
        assert storage.delete(Attempt(1, 0))
        assert storage.attempts() == []
