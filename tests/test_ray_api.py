"""Ray Train's API under elastic_train, used as Ray's user guides use it.

1. The driver side: fit() raises on failure, callbacks, Result (best checkpoints, from_path after
   the driver died), restore without the loop, Checkpoint.to_directory, TorchTrainer's torch_config /
   metadata / resume_from_checkpoint.
2. The names: TorchConfig, the `elastic_train.torch` loop helpers, the context's trial / metadata /
   storage methods, and a clear error for every `ray.train` name we do not provide.
3. report() with Ray's keywords: every reported checkpoint kept, SYNC, NO_UPLOAD (a DCP checkpoint the
   loop wrote), checkpoint_dir_name, delete_local_checkpoint_after_upload, checkpoint_upload_fn,
   get_all_reported_checkpoints, and reports that wait for storage rather than drop a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import posixpath
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import ray.train  # the configs compared field by field below (a test run alone has not imported it)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, TensorDataset

import elastic_train as train
from elastic_train import Checkpoint, CheckpointUploadMode, RunConfig, ScalingConfig
from chaos.storage_proxy import FaultyStorageProxy, StorageFaults
from elastic_train.checkpoint import list_checkpoints
from elastic_train.checkpoint.manifest import MANIFEST
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.driver.launch import attach
from elastic_train.protocol import Assignment, PreemptionInfo
from elastic_train.run_spec import RunInfo
from elastic_train.torch import TorchConfig, TorchTrainer
from elastic_train.unsupported import TRAIN_NAMES, UnsupportedAPIError
from elastic_train.worker.loop.context import StorageContext, TrainContext
from elastic_train.worker.store.queue import PartToStore, StoreQueue
from tests.conftest import ROOT, ray_runtime_env, stop_ray
from tests.helpers import supervisor_alive, make_trainer, wait_for
from tests.loops import large_shard_loop, log_progress, read_progress
from tests.test_user_programs import once


# == 1. The driver side ============================================================================
SCORES = [0.5, 0.9, 0.2]


def three_epochs(config: dict) -> None:
    """Rank 0 saves a checkpoint with each epoch's report, as Ray Train's guides do; every rank reports."""
    ctx = train.get_context()
    for epoch in range(len(SCORES)):
        checkpoint = train.Checkpoint.from_dict({"epoch": epoch}) if ctx.get_world_rank() == 0 else None
        train.report({"epoch": epoch, "score": SCORES[epoch], "rank": ctx.get_world_rank()}, checkpoint=checkpoint)


def raises_on(config: dict) -> None:
    """Reports once, then raises on the configured ranks."""
    rank = train.get_context().get_world_rank()
    train.report({"step": 1}, checkpoint=train.Checkpoint.from_dict({"step": 1}))
    if rank in config["ranks"]:
        raise ValueError(f"bad batch on rank {rank}")
    train.report({"step": 2})


def endless(config: dict) -> None:
    step = 0
    while True:
        step += 1
        threading.Event().wait(0.05)
        train.report({"step": step}, checkpoint=train.Checkpoint.from_dict({"step": step}))


def describes_its_setup(config: dict) -> None:
    ctx = train.get_context()
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    train.report({"backend": dist.get_backend(), "timeout_s": backend.options._timeout.total_seconds(),
               "metadata": ctx.get_metadata()})


def starts_from_given_checkpoint(config: dict) -> None:
    checkpoint = train.get_checkpoint()
    start = checkpoint.to_dict()["step"] if checkpoint is not None else 0
    for step in range(start + 1, start + 3):
        train.report({"step": step, "started_from": start}, checkpoint=train.Checkpoint.from_dict({"step": step}))


def _run_config(run_dirs: dict, **kwargs) -> train.RunConfig:
    return train.RunConfig(storage_path=run_dirs["storage"], name="run", **kwargs)


class Recorder(train.UserCallback):
    """Keeps what each hook was called with."""

    def __init__(self):
        self.reports: list[tuple[list[dict], dict | None]] = []
        self.exceptions: list[dict[int, BaseException]] = []
        self.ended: list[train.Result] = []
        self.run_names: set[str] = set()

    def after_report(self, run_context, metrics, checkpoint):
        self.run_names.add(run_context.name)
        self.reports.append((metrics, checkpoint.to_dict() if checkpoint is not None else None))

    def after_exception(self, run_context, worker_exceptions):
        self.exceptions.append(worker_exceptions)

    def on_run_end(self, run_context, result):
        self.ended.append(result)


@pytest.mark.timeout(120)
def test_callbacks_see_every_report_and_result_keeps_every_checkpoint(local_ray, run_dirs, tmp_path):
    recorder = Recorder()
    result = train.TorchTrainer(
        three_epochs, train_loop_config={}, scaling_config=train.ScalingConfig(num_workers=2),
        run_config=_run_config(run_dirs, callbacks=[recorder]),
    ).fit()
    # Every report, with every rank's metrics, and the checkpoint committed for it.
    assert [[m["rank"] for m in metrics] for metrics, _ in recorder.reports] == [[0, 1]] * 3
    assert [metrics[0]["epoch"] for metrics, _ in recorder.reports] == [0, 1, 2]
    assert [checkpoint for _, checkpoint in recorder.reports] == [{"epoch": 0}, {"epoch": 1}, {"epoch": 2}]
    assert recorder.run_names == {"run"} and recorder.exceptions == []
    assert len(recorder.ended) == 1 and recorder.ended[0].error is None
    # Three reported checkpoints, three kept (num_to_keep unset), each with its metrics.
    assert [(c.to_dict()["epoch"], m["score"]) for c, m in result.best_checkpoints] == list(enumerate(SCORES))
    assert result.get_best_checkpoint("score", "max").to_dict() == {"epoch": 1}
    assert result.get_best_checkpoint("score", "min").to_dict() == {"epoch": 2}
    with pytest.raises(RuntimeError, match="Invalid metric name"):
        result.get_best_checkpoint("accuracy", "max")
    # to_directory: into a given folder, or a new temporary one.
    target = result.checkpoint.to_directory(tmp_path / "ckpt")
    assert target == str(tmp_path / "ckpt") and os.listdir(target) == ["dict_checkpoint.pt"]
    assert train.Checkpoint.from_directory(result.checkpoint.to_directory()).to_dict() == {"epoch": 2}
    # The run's folder holds what Result needs: from_path reads it back.
    again = train.Result.from_path(result.path)
    assert again.metrics == result.metrics and again.metrics_history == result.metrics_history
    assert [c.to_dict() for c, _ in again.best_checkpoints] == [{"epoch": e} for e in range(3)]
    assert again.error is None and again.world_sizes == [2]


def reports_its_env() -> None:
    context = train.get_context()
    train.report({f"{name}_{context.get_world_rank()}": os.environ[name] for name in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "ACCELERATE_TORCH_DEVICE")})


@pytest.mark.timeout(120)
def test_every_worker_has_the_environment_ray_train_sets(local_ray, run_dirs):
    """As Ray's TorchConfig sets them on every worker (Accelerate reads its device from them), whatever
    the loop imports."""
    recorder = Recorder()
    train.TorchTrainer(reports_its_env, scaling_config=train.ScalingConfig(num_workers=2),
                       run_config=_run_config(run_dirs, callbacks=[recorder])).fit()
    reported = {name: value for per_rank in recorder.reports[0][0] for name, value in per_rank.items()}
    for rank in (0, 1):
        assert [reported[f"{n}_{rank}"] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                                  "ACCELERATE_TORCH_DEVICE")] == [str(rank), str(rank), "2", "2", "0", "cpu"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [[1], [0, 1]])
def test_a_worker_error_raises_worker_group_error_with_the_traceback(local_ray, run_dirs, ranks):
    recorder = Recorder()
    trainer = train.TorchTrainer(raises_on, train_loop_config={"ranks": ranks},
                              scaling_config=train.ScalingConfig(num_workers=2),
                              run_config=_run_config(run_dirs, callbacks=[recorder]))
    with pytest.raises(train.WorkerGroupError) as caught:
        trainer.fit()
    error = caught.value
    assert isinstance(error, train.TrainingFailedError)
    assert sorted(error.worker_failures) == ranks
    for rank, exc in error.worker_failures.items():
        assert isinstance(exc, ValueError) and str(exc) == f"bad batch on rank {rank}"
        assert "raises_on" in "".join(exc.__notes__)  # the worker's traceback
    assert "Traceback" in str(error) and "raises_on" in str(error) and "ValueError: bad batch" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is train.WorkerGroupError and str(copy) == str(error) and sorted(copy.worker_failures) == ranks
    # after_exception gets the errors known when the failure was seen (as Ray's, from one poll of the
    # workers); fit()'s error has every rank that raised.
    assert len(recorder.exceptions) == 1 and recorder.exceptions[0] and set(recorder.exceptions[0]) <= set(ranks)
    assert recorder.ended[0].error is error
    # What the failed run left is read back from its folder.
    left = train.Result.from_path(str(Path(run_dirs["storage"], "run")))
    assert isinstance(left.error, train.TrainingFailedError) and "bad batch" in str(left.error)
    assert left.metrics == {"step": 1} and left.checkpoint.to_dict() == {"step": 1}


@pytest.mark.timeout(60)
def test_capacity_that_never_comes_raises_controller_error(local_ray, run_dirs):
    trainer = train.TorchTrainer(three_epochs, scaling_config=train.ScalingConfig(num_workers=3),
                              run_config=_run_config(run_dirs, elastic_config=train.ElasticConfig(min_workers_timeout_s=2)))
    with pytest.raises(train.ControllerError) as caught:
        trainer.fit()
    assert "min_workers_timeout_s" in str(caught.value)
    assert "min_workers_timeout_s" in str(caught.value.controller_failure)


class Raising(train.UserCallback):
    def __init__(self, exc: BaseException):
        self.exc = exc

    def after_report(self, run_context, metrics, checkpoint):
        if metrics[0]["step"] == 3:
            raise self.exc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exc", [KeyError("no such run in the tracker"), SystemExit(0)], ids=["error", "exit"])
def test_a_raising_callback_stops_the_run_cleanly(local_ray, run_dirs, exc):
    """As in Ray Train, a callback's error fails the run with ControllerError; a SystemExit (Tune's
    way to stop a trial from its report) propagates. Either way the run was stopped cleanly first:
    its supervisor is gone and the newest checkpoint is committed."""
    trainer = train.TorchTrainer(endless, train_loop_config={}, scaling_config=train.ScalingConfig(num_workers=2),
                              run_config=_run_config(run_dirs, callbacks=[Raising(exc)]))
    if isinstance(exc, SystemExit):
        with pytest.raises(SystemExit):
            trainer.fit()
    else:
        with pytest.raises(train.ControllerError) as caught:
            trainer.fit()
        assert caught.value.controller_failure is exc
    with pytest.raises(ValueError):
        attach("run")
    left = train.Result.from_path(str(Path(run_dirs["storage"], "run")))
    assert left.checkpoint.to_dict()["step"] >= 3
    assert any(e["kind"] == "stop_requested" for e in left.events)
    assert (left.error is None) == isinstance(exc, SystemExit)


@pytest.mark.timeout(120)
def test_stop_from_another_thread_ends_fit_with_a_result(local_ray, run_dirs):
    reported = threading.Event()

    class Seen(train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            reported.set()

    trainer = train.TorchTrainer(endless, train_loop_config={}, scaling_config=train.ScalingConfig(num_workers=2),
                              run_config=_run_config(run_dirs, callbacks=[Seen()]))
    results = []
    fitting = threading.Thread(target=lambda: results.append(trainer.fit()))
    fitting.start()
    assert reported.wait(60)
    assert trainer.stop("the trial was stopped", timeout_s=60)
    fitting.join(5)
    result = results[0]
    assert result.error is None and result.checkpoint.to_dict()["step"] == result.metrics["step"]
    assert any(e["kind"] == "stop_requested" and e["reason"] == "the trial was stopped" for e in result.events)
    assert trainer.stop("again")  # nothing under way


@pytest.mark.timeout(120)
def test_after_resize_follows_the_world_size(local_ray, run_dirs):
    """An elastic run loses rank 1's process, shrinks, and grows back when its replacement is placed."""
    resizes = []

    class Resizes(train.UserCallback):
        def after_resize(self, run_context, old_world_size, new_world_size):
            resizes.append((old_world_size, new_world_size))

    trainer = make_trainer(run_dirs, (1, 2), steps=30, step_time=0.05, fault={"kind": "kill", "rank": 1, "at_step": 5})
    trainer.run_config = dataclasses.replace(trainer.run_config, callbacks=[Resizes()])
    result = trainer.fit()
    sizes = result.world_sizes
    assert sizes[0] == 2 and 1 in sizes, sizes
    assert resizes == [(a, b) for a, b in zip(sizes, sizes[1:]) if a != b]


@pytest.mark.timeout(120)
def test_torch_config_and_metadata_reach_the_loop(local_ray, run_dirs):
    result = train.TorchTrainer(
        describes_its_setup, torch_config=TorchConfig(backend="gloo", timeout_s=123),
        metadata={"dataset": "v3", "owner": "ml"}, scaling_config=train.ScalingConfig(num_workers=2),
        run_config=_run_config(run_dirs),
    ).fit()
    assert result.metrics == {"backend": "gloo", "timeout_s": 123.0, "metadata": {"dataset": "v3", "owner": "ml"}}


@pytest.mark.timeout(120)
def test_resume_from_checkpoint_is_the_first_get_checkpoint(local_ray, run_dirs):
    result = train.TorchTrainer(
        starts_from_given_checkpoint, train_loop_config={},
        resume_from_checkpoint=train.Checkpoint.from_dict({"step": 40}),
        scaling_config=train.ScalingConfig(num_workers=2), run_config=_run_config(run_dirs),
    ).fit()
    assert [m["step"] for m in result.metrics_history] == [41, 42]
    # A run with checkpoints of its own resumes from them, not from the given one.
    again = train.TorchTrainer(
        starts_from_given_checkpoint, train_loop_config={},
        resume_from_checkpoint=train.Checkpoint.from_dict({"step": 40}),
        scaling_config=train.ScalingConfig(num_workers=2), run_config=_run_config(run_dirs),
    ).fit()
    assert [m["started_from"] for m in again.metrics_history] == [42, 42]


@pytest.mark.timeout(240)
def test_from_path_after_the_driver_was_killed_and_restore_without_the_loop(local_ray, run_dirs):
    run = Path(run_dirs["storage"], "run")
    args = {"address": ray.get_runtime_context().gcs_address, "storage": run_dirs["storage"], "name": "run",
            "workers": 2, "config": {"log_dir": run_dirs["log_dir"], "steps": 10_000, "shard_mb": 0.01,
                                     "step_time": 0.05}}
    driver = subprocess.Popen([sys.executable, "-m", "tests.driver", json.dumps(args)], cwd=ROOT,
                              env={**os.environ, **ray_runtime_env()["env_vars"]})
    try:
        wait_for(lambda: (run / "metrics.json").exists() and json.loads((run / "metrics.json").read_text()), 120,
                 "the driver to record metrics")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    left = train.Result.from_path(str(run))
    steps = [m["step"] for m in left.metrics_history]
    assert steps == list(range(1, len(steps) + 1)) and left.metrics["step"] == steps[-1]
    assert left.error is None and left.best_checkpoints and left.events[0]["kind"] == "run_started"
    with left.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == ["shard_0.bin", "shard_1.bin"]
    wait_for(lambda: not supervisor_alive("run"), 60, "the dead driver's supervisor to go")

    restored = train.TorchTrainer.restore(str(run), train_loop_config={**args["config"], "steps_after_restore": 2})
    assert restored.train_loop_per_worker is large_shard_loop
    assert restored.scaling_config.num_workers == 2
    result = restored.fit()
    resumed_from = result.metrics_history[0]["step"] - 1
    assert resumed_from >= left.best_checkpoints[-1][1]["step"]  # the newest committed checkpoint, or newer
    assert [m["step"] for m in result.metrics_history] == [resumed_from + 1, resumed_from + 2]


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_driver_aborts_a_loop_that_never_reports_again(local_ray, run_dirs):
    """Ray's test_sigint_abort: one SIGINT to the driver while its loop computes without reporting ends
    the run at once (its workers ended, not waited for: drain_timeout_s is 30 s), and the driver exits."""
    run = Path(run_dirs["storage"], "spin")
    args = {"address": ray.get_runtime_context().gcs_address, "storage": run_dirs["storage"], "name": "spin",
            "workers": 2, "loop": "spins_after_one_report", "config": {}}
    log = Path(run_dirs["log_dir"], "driver.err")
    driver = subprocess.Popen([sys.executable, "-m", "tests.driver", json.dumps(args)], cwd=ROOT,
                              stderr=log.open("w"), env={**os.environ, **ray_runtime_env()["env_vars"]})
    try:
        wait_for(lambda: (run / "metrics.json").exists() and json.loads((run / "metrics.json").read_text()), 90,
                 "the first report")
        interrupted = time.monotonic()
        driver.send_signal(signal.SIGINT)
        driver.wait(timeout=20)
        took = time.monotonic() - interrupted
    finally:
        driver.kill()
    assert took < train.ElasticConfig().drain_timeout_s / 2, took
    assert json.loads((run / "run.json").read_text())["state"].lower() == "errored"
    assert train.Result.from_path(str(run)).events[-1] == {**train.Result.from_path(str(run)).events[-1],
                                                           "kind": "run_ended", "state": "ERRORED"}
    assert "aborting the run: KeyboardInterrupt in the driver" in log.read_text()
    wait_for(lambda: not supervisor_alive("spin"), 30, "the aborted run's supervisor to go")


def test_errors_pickle_whole():
    notice = PreemptionInfo(deadline_ms=1_700_000_000_000, preempted_node_to_ranks={"node-a": [0, 1]})
    for error in (train.ControllerError(RuntimeError("no capacity")), train.PreemptionError(notice, drain_timed_out=True)):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(train.PreemptionError(notice))).preemption_info.preempted_ranks == [0, 1]


def test_unsupported_arguments_fail_clearly():
    with pytest.raises(train.ConfigError, match=r"datasets\['train'\] must be a ray.data.Dataset"):
        train.TorchTrainer(three_epochs, datasets={"train": [1, 2]})
    with pytest.raises(train.ConfigError, match="use_gpu=True"):
        train.TorchTrainer(three_epochs, torch_config=TorchConfig(backend="nccl"))
    with pytest.raises(train.ConfigError, match="JSON"):
        train.TorchTrainer(three_epochs, metadata={"when": object()})
    with pytest.raises(train.ConfigError, match="UserCallback"):
        train.RunConfig(callbacks=[object()])


def test_restore_of_a_folder_that_is_no_run_fails_clearly(tmp_path):
    assert not train.TorchTrainer.can_restore(str(tmp_path / "nothing"))
    with pytest.raises(train.ConfigError, match="neither a run record"):
        train.TorchTrainer.restore(str(tmp_path / "nothing"))


class _Planted:
    """A trainer.pkl that, once unpickled, creates the file `marker`: proof that it was loaded."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_only_restore_without_a_loop_unpickles_and_a_bad_trainer_pkl_fails_clearly(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"state": "FINISHED"}))
    marker = tmp_path / "unpickled"
    (run / "trainer.pkl").write_bytes(pickle.dumps(_Planted(str(marker))))
    # Reading a result, checking, and restoring with the loop read JSON and manifests only.
    assert train.TorchTrainer.can_restore(str(run))
    assert train.Result.from_path(str(run)).checkpoint is None
    assert train.TorchTrainer.restore(str(run), three_epochs).train_loop_per_worker is three_epochs
    assert not marker.exists()
    # Restoring without the loop loads trainer.pkl: documented as running code from storage.
    with pytest.raises(train.ConfigError, match="is not one this release wrote"):
        train.TorchTrainer.restore(str(run))
    assert marker.exists()
    (run / "trainer.pkl").write_bytes(b"\x80\x05 damaged")
    with pytest.raises(train.ConfigError, match=r"trainer.pkl could not be loaded .*pass the loop"):
        train.TorchTrainer.restore(str(run))
    (run / "trainer.pkl").unlink()
    with pytest.raises(train.ConfigError, match=r"there is no trainer.pkl.*restore\(path, train_loop_per_worker\)"):
        train.TorchTrainer.restore(str(run))


def counting_loop(config: dict) -> None:
    """Rank 0 checkpoints each step; resumes after the newest checkpoint."""
    checkpoint = train.get_checkpoint()
    start = checkpoint.to_dict()["step"] if checkpoint is not None else 0
    for step in range(start + 1, config["steps"] + 1):
        saved = train.Checkpoint.from_dict({"step": step}) if train.get_context().get_world_rank() == 0 else None
        train.report({"step": step}, checkpoint=saved)


@pytest.mark.timeout(240)
def test_restore_from_s3_as_seed_002_writes_it(run_dirs, s3_bucket, monkeypatch):
    """`TorchTrainer.restore("s3://...")` with nothing else: the loop comes from the run's folder, the
    credentials from the environment (the driver's and the workers'), as on a real cluster."""
    aws = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": s3_bucket["endpoint"]}
    for key, value in aws.items():
        monkeypatch.setenv(key, value)
    stop_ray()
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {**ray_runtime_env()["env_vars"], **aws}})
    try:
        first = TorchTrainer(counting_loop, train_loop_config={"steps": 3}, scaling_config=ScalingConfig(num_workers=2),
                             run_config=RunConfig(name="seed-run", storage_path=s3_bucket["url"])).fit()
        url = f"{s3_bucket['url']}/seed-run"
        assert first.path == url and train.TorchTrainer.can_restore(url)
        restored = TorchTrainer.restore(url)
        assert restored.train_loop_per_worker is counting_loop and restored.train_loop_config == {"steps": 3}
        assert restored.fit().metrics_history == []  # nothing left to run: it resumed after step 3
        result = TorchTrainer.restore(url, train_loop_config={"steps": 5}).fit()
    finally:
        stop_ray()
    assert [m["step"] for m in result.metrics_history] == [4, 5]
    assert result.checkpoint.to_dict() == {"step": 5} and result.path == url


# == 2. The names ==================================================================================
# == TorchConfig ====================================================================================
def test_torch_config_defaults_are_rays():
    config = TorchConfig()
    assert config.to_dict() == {"backend": None, "init_method": "env", "timeout_s": 1800}
    assert config.resolve_backend(use_gpu=False) == "gloo"
    assert config.resolve_backend(use_gpu=True) == "nccl"
    assert TorchConfig(backend="gloo", init_method="tcp", timeout_s=60).resolve_backend(use_gpu=False) == "gloo"
    assert TorchConfig(backend="nccl").resolve_backend(use_gpu=True) == "nccl"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "mpi"}, r"backend='mpi': use 'nccl' \(GPUs\), 'gloo' \(CPUs\), or None"),
        ({"backend": "cpu:gloo,cuda:nccl"}, "use 'nccl'"),
        ({"init_method": "file"}, "init_method='file': use 'env' or 'tcp'"),
        ({"timeout_s": 0}, "timeout_s=0: use a positive number of seconds"),
        ({"timeout_s": True}, "timeout_s=True"),
    ],
)
def test_torch_config_rejects_bad_values(kwargs, message):
    with pytest.raises(train.ConfigError, match=message):
        TorchConfig(**kwargs)


def test_torch_config_backend_must_fit_the_devices():
    with pytest.raises(train.ConfigError, match=r"needs GPUs: set ScalingConfig\(use_gpu=True\)"):
        TorchConfig(backend="nccl").resolve_backend(use_gpu=False)
    with pytest.raises(train.ConfigError, match="Use backend='nccl'"):
        TorchConfig(backend="gloo").resolve_backend(use_gpu=True)


# == names of ray.train we do not provide ===========================================================
@pytest.mark.parametrize("name", sorted(TRAIN_NAMES))
def test_unsupported_ray_train_name_imports_and_says_what_to_use_when_built(name):
    """Imported beside the names a program uses, as in Ray (Ray's test utilities import SyncConfig);
    building one says why it is not supported and what to use."""
    namespace: dict = {}
    exec(f"from elastic_train import {name}", namespace)
    with pytest.raises(UnsupportedAPIError, match=rf"elastic_train\.{name} \(ray\.train\.{name}\) is not supported: "
                                                  + re.escape(TRAIN_NAMES[name])):
        namespace[name]()


def test_nccl_hang_error_is_caught_as_in_ray():
    """Ray's, for code that catches it; never raised here (a hang is aborted and recovered in place)."""
    from elastic_train import NCCLHangError

    assert issubclass(NCCLHangError, train.WorkerGroupError) and NCCLHangError.__module__ == "elastic_train.errors"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("module, trainer", [("tensorflow", "TensorflowTrainer"), ("xgboost", "XGBoostTrainer"),
                                             ("lightgbm", "LightGBMTrainer"), ("horovod", "HorovodTrainer"),
                                             ("v2.jax", "JaxTrainer")])
def test_rays_trainers_for_other_frameworks_say_what_to_use(module, trainer):
    """Ray's trainers for other frameworks, named in the documents users read: importing one says why
    it fails and what to use, as every other Ray name we do not provide does, not a bare
    ModuleNotFoundError; a module that is nobody's stays a ModuleNotFoundError."""
    with pytest.raises(UnsupportedAPIError, match=rf"elastic_train\.{re.escape(module)} \(ray\.train\."
                                                  rf"{re.escape(module)}\) is not supported: elastic_train trains "
                                                  r"PyTorch: use elastic_train\.torch\.TorchTrainer"):
        exec(f"from elastic_train.{module} import {trainer}", {})
    with pytest.raises(ModuleNotFoundError):
        exec("import elastic_train.no_such_module", {})


def test_other_missing_names_are_plain_attribute_errors():
    assert not hasattr(train, "no_such_name")
    assert not hasattr(train.torch, "no_such_name")
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec("from elastic_train import no_such_name", {})


@pytest.mark.parametrize("module, ours", [
    ("ray.train", "elastic_train"),
    ("ray.train.torch", "elastic_train.torch"),
    ("ray.train.collective", "elastic_train.collective"),
])
def test_every_public_ray_train_name_exists(module, ours):
    """The porting rule `ray.train` -> `elastic_train`: each name of Ray's `__all__` imports from ours
    (one we do not support says what to use instead when built: unsupported.py)."""
    import importlib

    ray_module, our_module = importlib.import_module(module), importlib.import_module(ours)
    missing = [name for name in ray_module.__all__ if not hasattr(our_module, name)]
    assert not missing, f"{ours} lacks {missing}: provide them, or refuse them in elastic_train/unsupported.py"


@pytest.mark.parametrize("name", ["ScalingConfig", "RunConfig", "FailureConfig", "CheckpointConfig"])
def test_every_field_of_rays_configs_exists_or_says_what_to_use(name):
    ray_fields = {f.name for f in dataclasses.fields(getattr(ray.train, name))}
    ours = getattr(train, name)
    missing = sorted(ray_fields - {f.name for f in dataclasses.fields(ours)} - set(ours.RAY_ONLY_FIELDS))
    assert not missing, f"{name} lacks Ray's fields {missing}: take them, or say what to use instead (config/)"


def test_scaling_config_takes_rays_resize_interval():
    assert ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=5).elastic_resize_monitor_interval_s == 5
    with pytest.raises(train.ConfigError, match="elastic_resize_monitor_interval_s must be a number of seconds >= 0"):
        ScalingConfig(elastic_resize_monitor_interval_s=-1)


def test_checkpoint_metadata_as_rays(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    directory = Checkpoint.from_directory(folder)
    assert directory.get_metadata() == {}
    directory.set_metadata({"epoch": 3, "tags": ["a"]})
    directory.update_metadata({"loss": 0.5})
    assert Checkpoint.from_directory(folder).get_metadata() == {"epoch": 3, "tags": ["a"], "loss": 0.5}
    assert json.loads((folder / ".metadata.json").read_text())["epoch"] == 3  # Ray's file name
    in_memory = Checkpoint.from_dict({"w": torch.ones(2)})
    in_memory.set_metadata({"epoch": 1})
    from elastic_train.checkpoint.checkpoint import checkpoint_from_files

    again = checkpoint_from_files(in_memory.files(), str(tmp_path))  # what a report keeps and a resume gives back
    assert again.get_metadata() == {"epoch": 1} and torch.equal(again.to_dict()["w"], torch.ones(2))
    with pytest.raises(TypeError):
        in_memory.set_metadata({"not json": object()})


# == loop helpers without a run =====================================================================
@pytest.fixture
def deterministic_restored():
    """enable_reproducibility changes process-wide torch settings: put them back after the test."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark = before[1]
    if before[2] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[2]


def test_enable_reproducibility_seeds_every_generator(deterministic_restored):
    train.torch.enable_reproducibility(7)
    first = (torch.rand(3), random.random(), np.random.rand())
    train.torch.enable_reproducibility(7)
    second = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], second[0]) and first[1:] == second[1:]
    assert first[1] == random.Random(7).random()
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_amp_helpers_run_full_precision_and_refuse_amp():
    train.torch.accelerate()
    train.torch.accelerate(amp=False)  # again: a re-entered loop calls it once per generation
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert train.torch.prepare_optimizer(optimizer) is optimizer
    train.torch.backward(model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight.grad, torch.ones(1, 2))
    with pytest.raises(train.ConfigError, match=r"accelerate\(amp=True\) is not supported: .*torch.autocast"):
        train.torch.accelerate(amp=True)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        train.torch.prepare_optimizer(model)


def test_get_devices_is_the_cpu_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU case")
    assert train.torch.get_devices() == [train.torch.get_device()] == [torch.device("cpu")]


# == the context's trial, metadata and storage ======================================================
def context(tmp_path, run: RunInfo) -> TrainContext:
    place = Assignment(generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       master_addr="127.0.0.1", master_port=0, resume=None, peers={})
    return TrainContext(place, run, RunStorage(str(tmp_path / "storage"), run.name))


def test_trial_names_outside_and_inside_tune(tmp_path):
    alone = context(tmp_path, RunInfo("my-run"))
    assert alone.get_trial_name() == "my-run" and alone.get_trial_id() is None and alone.get_metadata() == {}
    trial = context(tmp_path, RunInfo("my-run", trial_name="train_fn_a1b2c_00001", trial_id="a1b2c_00001",
                                      metadata={"owner": "n"}))
    assert (trial.get_trial_name(), trial.get_trial_id()) == ("train_fn_a1b2c_00001", "a1b2c_00001")
    assert trial.get_metadata() == {"owner": "n"}
    trial.get_metadata()["owner"] = "changed"  # a copy: the run's metadata stays as given
    assert trial.get_metadata() == {"owner": "n"}
    with pytest.raises(NotImplementedError, match="get_world_size"):
        trial.get_trial_resources()


def test_storage_context_has_rays_paths(tmp_path):
    ctx = context(tmp_path, RunInfo("my-run"))
    storage = ctx.get_storage()
    root = str(tmp_path / "storage")
    assert (storage.storage_path, storage.storage_fs_path, storage.experiment_dir_name) == (root, root, "my-run")
    assert storage.experiment_fs_path == posixpath.join(root, "my-run") == ctx.get_trial_dir()
    path = storage.build_checkpoint_path_from_name("dcp_epoch_3")
    assert path == posixpath.join(root, "my-run", "dcp_epoch_3")
    assert storage.extract_checkpoint_dir_name_from_path(path) == "dcp_epoch_3"
    storage.storage_filesystem.makedirs(path, exist_ok=True)  # an fsspec filesystem, on the fs path
    storage.storage_filesystem.pipe_file(posixpath.join(path, "shard_0"), b"x")
    assert (tmp_path / "storage" / "my-run" / "dcp_epoch_3" / "shard_0").read_bytes() == b"x"
    for bad in ("", "/abs", "..", "../other-run", "dcp/epoch_3"):
        with pytest.raises(ValueError, match="directly under the run's folder"):
            storage.build_checkpoint_path_from_name(bad)


def test_storage_context_paths_drop_the_protocol_as_rays():
    storage = StorageContext.of(RunStorage("memory://bucket/prefix", "run"))
    assert storage.storage_path == "memory://bucket/prefix"
    assert storage.experiment_fs_path == "/bucket/prefix/run"
    assert storage.storage_filesystem.unstrip_protocol(storage.experiment_fs_path) == "memory:///bucket/prefix/run"


# == one run on real Ray, written as Ray's user guides write it =====================================
SEED, LR, EPOCHS = 11, 0.1, 3
X = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16
Y = X.sum(dim=1, keepdim=True)


def train_func(config):
    train.torch.enable_reproducibility(seed=config["seed"])
    fresh = {"random": random.random(), "numpy": float(np.random.rand())}  # right after seeding
    train.torch.accelerate(amp=False)
    model = train.torch.prepare_model(torch.nn.Linear(4, 1))
    optimizer = train.torch.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=config["lr"]))
    # Two samples a step per worker: each epoch is one step over the whole set, in some order.
    loader = train.torch.prepare_data_loader(DataLoader(TensorDataset(X, Y), batch_size=2, shuffle=True))

    ctx = train.get_context()
    storage = ctx.get_storage()
    assert train.torch.get_devices() == [train.torch.get_device()] == [torch.device("cpu")]
    assert ctx.get_trial_id() is None and ctx.get_trial_name() == ctx.get_experiment_name()
    assert ctx.get_metadata() == {"owner": "names-test"}
    assert torch.are_deterministic_algorithms_enabled()
    if ctx.get_world_rank() == 0:  # a file of the loop's own, under the run's folder on its filesystem
        notes = storage.build_checkpoint_path_from_name("notes")
        storage.storage_filesystem.makedirs(notes, exist_ok=True)
        storage.storage_filesystem.pipe_file(posixpath.join(notes, "rank0.txt"), b"written by the loop")

    for epoch in range(config["epochs"]):
        if ctx.get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            train.torch.backward(loss)
            optimizer.step()
        train.report({"epoch": epoch, "loss": loss.item(), **fresh,
                      "weight": model.module.weight.detach().flatten().tolist(),
                      "experiment_fs_path": storage.experiment_fs_path,
                      "experiment_dir_name": storage.experiment_dir_name})


def expected_weight() -> list[float]:
    """The run's math in this process: DDP averages the two halves' gradients, the whole set's."""
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        optimizer.step()
    return model.weight.detach().flatten().tolist()


@pytest.mark.timeout(120)
def test_a_ray_style_loop_runs_with_these_names(local_ray, run_dirs):
    result = TorchTrainer(
        train_func,
        train_loop_config={"seed": SEED, "lr": LR, "epochs": EPOCHS},
        torch_config=TorchConfig(backend="gloo", timeout_s=600),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="names", storage_path=run_dirs["storage"]),
        metadata={"owner": "names-test"},
    ).fit()
    metrics = result.metrics
    assert metrics["epoch"] == EPOCHS - 1
    assert metrics["weight"] == pytest.approx(expected_weight(), abs=1e-6)
    assert (metrics["random"], metrics["numpy"]) == (random.Random(SEED).random(),
                                                     float(np.random.RandomState(SEED).rand()))
    assert metrics["experiment_fs_path"] == result.path == os.path.join(run_dirs["storage"], "names")
    assert metrics["experiment_dir_name"] == "names"
    assert (
        open(os.path.join(result.path, "notes", "rank0.txt"), "rb").read() == b"written by the loop"
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make, field", [
    (lambda: train.RunConfig(logging_config=object()), "logging_config"),
    (lambda: train.RunConfig(worker_runtime_env={}), "worker_runtime_env"),
    (lambda: train.ScalingConfig(num_workers=2, use_tpu=True), "use_tpu"),
    (lambda: train.FailureConfig(controller_failure_limit=3), "controller_failure_limit"),
])
def test_ray_only_config_fields_say_what_to_use_instead(make, field):
    with pytest.raises(train.ConfigError, match=rf"\({field}=\.\.\.\) is Ray Train's; elastic_train does not support it: \w"):
        make()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("make, field", [
    (lambda: train.FailureConfig(fail_fast=True), "fail_fast"),
    (lambda: train.RunConfig(verbose=0), "verbose"),
    (lambda: train.RunConfig(stop={"step": 3}), "stop"),
    (lambda: train.ScalingConfig(trainer_resources={"CPU": 1}), "trainer_resources"),
    (lambda: train.CheckpointConfig(checkpoint_frequency=2), "checkpoint_frequency"),
])
def test_fields_ray_deprecated_raise_a_deprecation_warning_as_in_ray(make, field):
    """Ray raises `DeprecationWarning` for them: so do we, with what to use instead (and a ConfigError)."""
    with pytest.raises(DeprecationWarning, match=rf"\({field}=\.\.\.\) is deprecated \(as in Ray Train\): \w"):
        make()
    with pytest.raises(train.ConfigError):
        make()


@pytest.mark.timeout(10)
def test_scaling_config_total_resources_is_what_the_workers_ask_for_at_most():
    assert ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 1}).total_resources == {
        "CPU": 2, "GPU": 2}
    assert ScalingConfig(num_workers=(1, 3)).total_resources == {"CPU": 3}
    assert ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5, "memory": 0}).total_resources == {"CPU": 1}
    local = ScalingConfig(num_workers=0)  # Ray's local mode: one worker here
    assert (local.min_workers, local.max_workers, local.total_resources) == (1, 1, {"CPU": 1})


@pytest.mark.timeout(10)
def test_scaling_config_asks_for_the_resources_ray_asks_for():
    """As Ray's `_resources_per_worker_not_none`: a GPU worker asks for no CPU unless told (a GPU node may
    have few CPUs per GPU), `resources_per_worker` is taken as given, and `use_gpu` agrees with it."""
    assert ScalingConfig(use_gpu=True).total_resources == {"GPU": 1}
    assert ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 1}).total_resources == {
        "CPU": 2, "GPU": 2}
    assert ScalingConfig(resources_per_worker={"memory": 2**30}).worker_resources() == {"memory": 2**30}
    with pytest.raises(ValueError, match="`use_gpu` is False but `GPU` was found in"):
        ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"GPU": 1})
    assert ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 0}).worker_resources() == {"GPU": 1}


# == 3. report() and its keywords ==================================================================
def _run(run_dirs, loop, num_workers=2, name="run", checkpoint_config=None, **config):
    return TorchTrainer(loop, train_loop_config={"log_dir": run_dirs["log_dir"], **config},
                        scaling_config=ScalingConfig(num_workers=num_workers),
                        run_config=RunConfig(name=name, storage_path=run_dirs["storage"],
                                             checkpoint_config=checkpoint_config)).fit()


def epochs_loop(config):
    """Ray's guide: a checkpoint every epoch, rank 0 alone writes it; SYNC, named folders."""
    ctx = train.get_context()
    for epoch in range(config["epochs"]):
        metrics = {"epoch": epoch, "loss": 1.0 / (epoch + 1)}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save({"epoch": epoch}, os.path.join(temp_checkpoint_dir, "model.pt"))
                checkpoint = Checkpoint.from_directory(temp_checkpoint_dir)
            train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{epoch}",
                         checkpoint_upload_mode=config.get("mode"))
            if ctx.get_world_rank() == 0:
                stored = [c.manifest.step for c in list_checkpoints(ctx.get_trial_dir())]
                reported = train.get_all_reported_checkpoints()
                log_progress(config["log_dir"], epoch=epoch, stored=stored,
                             reported=[r.metrics["epoch"] for r in reported])


@pytest.mark.timeout(120)
def test_every_reported_checkpoint_is_kept_and_sync_returns_once_committed(local_ray, run_dirs):
    # A cadence that would store every 2nd checkpoint: a SYNC report is stored whatever the cadence.
    result = _run(run_dirs, epochs_loop, epochs=3, mode=CheckpointUploadMode.SYNC,
                  checkpoint_config=train.CheckpointConfig(store_every_n_reports=2))
    # Ray's contract: every reported checkpoint is kept (num_to_keep unset), in order.
    assert [m["epoch"] for _, m in result.best_checkpoints] == [0, 1, 2]
    assert [os.path.basename(c.path) for c, _ in result.best_checkpoints] == ["epoch_0", "epoch_1", "epoch_2"]
    # SYNC: when report() returned, that checkpoint's manifest was in storage, and listed as reported.
    for line in read_progress(run_dirs["log_dir"]):
        assert line["stored"][-1] == line["epoch"] + 1, line
        assert line["reported"] == list(range(line["epoch"] + 1)), line
    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "model.pt"))["epoch"] == 2


def latest_checkpoint_loop(config):
    """Ray's test_report_mixed_checkpoint_upload_modes, shortened: two ranks report in different modes in
    one round, and after each report get_checkpoint() answers what Ray's does: the checkpoint as
    reported (NO_UPLOAD), the stored one (SYNC; ASYNC once committed), the same one after a report
    without a checkpoint."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    modes = [["ASYNC", "SYNC", "NO_UPLOAD", None], ["SYNC", None, "NO_UPLOAD", "ASYNC"]][rank]
    for i, mode in enumerate(modes):
        name, checkpoint = f"iteration_{i}", None
        if mode is not None:
            folder = (ctx.get_storage().build_checkpoint_path_from_name(name) if mode == "NO_UPLOAD"
                      else os.path.join(config["log_dir"], f"{name}_{rank}"))
            os.makedirs(folder, exist_ok=True)
            Path(folder, f"shard_{rank}").write_text(str(i))
            checkpoint = Checkpoint(folder)
        before = train.get_checkpoint()
        train.report({"i": i}, checkpoint=checkpoint, checkpoint_dir_name=name if mode else None,
                     checkpoint_upload_mode=CheckpointUploadMode[mode or "ASYNC"])
        latest = train.get_checkpoint()
        if mode == "ASYNC" and i == len(modes) - 1:  # Ray's moves to it once its upload is done
            latest = wait_for(lambda: (lambda c: c if c is not None and c.path.endswith(name) else None)(
                train.get_checkpoint()), 60, f"get_checkpoint() to answer {name}")
        log_progress(config["log_dir"], rank=rank, i=i, mode=mode, name=name, before=before and before.path,
                     latest=latest and latest.path, as_reported=checkpoint is not None and latest == checkpoint)


@pytest.mark.timeout(120)
def test_get_checkpoint_answers_each_ranks_newest_checkpoint_in_every_upload_mode(local_ray, run_dirs):
    _run(run_dirs, latest_checkpoint_loop)
    lines = read_progress(run_dirs["log_dir"])
    assert len(lines) == 8
    for line in lines:
        if line["mode"] is None:
            assert line["latest"] == line["before"], line
        elif line["mode"] == "NO_UPLOAD":
            assert line["as_reported"], line
        elif line["mode"] == "ASYNC" and line["i"] < 3:  # the one before it, or it once committed: never older
            assert line["latest"] == line["before"] or (line["latest"] or "").endswith(line["name"]), line
        else:  # SYNC at once, the last ASYNC one once committed; stored, not the loop's folder
            assert line["latest"].endswith(line["name"]) and not line["latest"].startswith(run_dirs["log_dir"]), line


def committed_on_return_loop(config):
    """Ray's guide: rank 0 alone checkpoints each epoch. Right after report() returns, rank 0 looks
    in storage for that checkpoint's manifest."""
    ctx = train.get_context()
    storage = ctx.get_storage()
    for epoch in range(config["epochs"]):
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                torch.save({"epoch": epoch}, os.path.join(temp_checkpoint_dir, "model.pt"))
                checkpoint = Checkpoint.from_directory(temp_checkpoint_dir)
                checkpoint.set_metadata({"epoch": epoch})
            train.report({"epoch": epoch}, checkpoint=checkpoint, checkpoint_dir_name=f"epoch_{epoch}",
                         checkpoint_upload_mode=CheckpointUploadMode[config["mode"]])
        if ctx.get_world_rank() == 0:
            manifest = posixpath.join(storage.build_checkpoint_path_from_name(f"epoch_{epoch}"), MANIFEST)
            storage.storage_filesystem.invalidate_cache()
            log_progress(config["log_dir"], epoch=epoch, committed=storage.storage_filesystem.exists(manifest))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["SYNC", "ASYNC"])
def test_on_slow_storage_sync_returns_once_committed_and_async_reports_drop_nothing(local_ray, run_dirs, s3_bucket,
                                                                                      mode):
    """Each upload takes longer than a step: SYNC returns only once the manifest is in storage; ASYNC
    returns before (the control, showing the check can tell), and still stores every checkpoint, in
    order (Ray's contract), though each report comes while the previous upload is under way."""
    with FaultyStorageProxy(s3_bucket["endpoint"], seed=3) as proxy:
        proxy.set_faults(StorageFaults(latency_s=0.4, methods=frozenset({"PUT", "POST"})))
        result = TorchTrainer(
            committed_on_return_loop, train_loop_config={"epochs": 3, "mode": mode, "log_dir": run_dirs["log_dir"]},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="run", storage_path=s3_bucket["url"],
                                 storage_options={**s3_bucket["options"], "endpoint_url": proxy.url})).fit()
    committed = [p["committed"] for p in read_progress(run_dirs["log_dir"])]
    assert committed == ([True] * 3 if mode == "SYNC" else [False] * 3)
    assert [m["epoch"] for _, m in result.best_checkpoints] == [0, 1, 2]
    assert [c.get_metadata() for c, _ in result.best_checkpoints] == [{"epoch": e} for e in range(3)]
    with pytest.raises(train.CheckpointError, match="is committed"):
        result.checkpoint.set_metadata({"epoch": 9})


def dcp_no_upload_loop(config):
    """The loop writes each checkpoint straight into the run's folder with torch.distributed.checkpoint,
    and registers it (NO_UPLOAD); on resume it loads it back with DCP."""
    ctx = train.get_context()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = {"model": model.state_dict(), "step": torch.tensor(0)}
            dcp.load(state, checkpoint_id=d)
            model.load_state_dict(state["model"])
            start = int(state["step"])
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), resumed=start,
                     weight=model.weight.sum().item())
    for step in range(start + 1, config["steps"] + 1):
        with torch.no_grad():
            model.weight.add_(0.1 * step)
        path = ctx.get_storage().build_checkpoint_path_from_name(f"dcp_step_{step}")
        dcp.save({"model": model.state_dict(), "step": torch.tensor(step)}, checkpoint_id=path)
        train.report({"step": step, "weight": model.weight.sum().item()}, checkpoint=Checkpoint(path),
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


@pytest.mark.timeout(180)
def test_no_upload_registers_a_dcp_checkpoint_the_loop_wrote(local_ray, run_dirs):
    first = _run(run_dirs, dcp_no_upload_loop, steps=3)
    assert [os.path.basename(c.path) for c, _ in first.best_checkpoints] == ["dcp_step_1", "dcp_step_2", "dcp_step_3"]
    newest = first.best_checkpoints[-1][0]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(newest.manifest.files)  # listed and checksummed
    # A new fit with the same name resumes from the newest registered checkpoint, loaded by DCP.
    second = _run(run_dirs, dcp_no_upload_loop, steps=5)
    resumed = [p for p in read_progress(run_dirs["log_dir"]) if "resumed" in p]
    assert {p["resumed"] for p in resumed} == {3} and {p["rank"] for p in resumed} == {0, 1}
    assert resumed[0]["weight"] == pytest.approx(first.metrics["weight"])
    assert [h["step"] for h in second.metrics_history] == [4, 5]


def delete_local_loop(config):
    folder = tempfile.mkdtemp(dir=config["log_dir"])
    with open(os.path.join(folder, "state.txt"), "w") as f:
        f.write("1")
    train.report({"step": 1}, checkpoint=Checkpoint.from_directory(folder),
                 checkpoint_upload_mode=CheckpointUploadMode.ASYNC)  # Ray: ASYNC deletes the local folder
    log_progress(config["log_dir"], rank=train.get_context().get_world_rank(), left=os.path.exists(folder))


@pytest.mark.timeout(120)
def test_async_deletes_the_local_folder_once_held_and_the_checkpoint_is_still_stored(local_ray, run_dirs):
    result = _run(run_dirs, delete_local_loop, num_workers=1)
    assert [p["left"] for p in read_progress(run_dirs["log_dir"])] == [False]
    with result.checkpoint.as_directory() as d:
        assert open(os.path.join(d, "state.txt")).read() == "1"


@pytest.mark.timeout(30)
def test_a_report_waits_for_room_when_storage_falls_behind_and_drops_nothing():
    """Every checkpoint is stored (none replaced); with `max_queued` parts waiting, the next submit
    waits until the upload thread takes one: memory stays bounded."""
    gate, stored = threading.Event(), []

    def upload(part: PartToStore) -> None:
        assert gate.wait(10)
        stored.append(part.index)

    queue = StoreQueue(upload, lambda p, e: None, lambda p, e: None, max_queued=2)
    for index in (1, 2, 3):  # 1 is being uploaded, 2 and 3 wait
        assert queue.submit(PartToStore(0, index, {"a": b"x"}, replaceable=False)) < 1.0
    waited: list[float] = []
    submitter = threading.Thread(target=lambda: waited.append(
        queue.submit(PartToStore(0, 4, {"a": b"x"}, replaceable=False))))
    submitter.start()
    submitter.join(0.3)
    assert submitter.is_alive(), "the 4th part did not wait for room"
    gate.set()
    submitter.join(10)
    assert waited and waited[0] >= 0.3
    assert queue.flush(10) and stored == [1, 2, 3, 4]
    queue.close(1)


def upload_fn_loop(config):
    """Ray's `checkpoint_upload_fn`: the user's own upload into the run's folder."""
    import shutil

    def upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
        target = train.get_context().get_storage().build_checkpoint_path_from_name(dir_name)
        shutil.copytree(checkpoint.path, target)
        return Checkpoint(target)

    for step in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "step.txt"), "w") as f:
                f.write(str(step))
            train.report({"step": step}, checkpoint=Checkpoint.from_directory(d), checkpoint_upload_fn=upload)


@pytest.mark.timeout(120)
def test_checkpoint_upload_fn_stores_the_users_way_and_the_checkpoint_is_committed(local_ray, run_dirs):
    result = _run(run_dirs, upload_fn_loop, num_workers=1)
    assert [m["step"] for _, m in result.best_checkpoints] == [1, 2]
    with result.checkpoint.as_directory() as d:
        assert open(os.path.join(d, "step.txt")).read() == "2"
    assert set(result.checkpoint.manifest.files) == {"step.txt"}


@pytest.mark.timeout(10)
def test_a_folder_name_that_passes_for_one_of_ours_is_refused():
    from elastic_train.checkpoint.layout import check_named_folder

    check_named_folder("epoch_5", 5, 0)
    check_named_folder("checkpoint_000005_g0000", 5, 0)  # the attempt's own name (checkpoint_upload_fn's default)
    for reserved in ("checkpoint_000005", "checkpoint_7", "checkpoint_000005_g0001"):
        with pytest.raises(train.CheckpointError, match="elastic_train's own folders; pick another"):
            check_named_folder(reserved, 5, 0)


# == 4. ray.train.collective, the loop's return value, a checkpoint of the wrong folder ==============
def collective_loop(config):
    """Ray's collective guide: rank 0 decides something and broadcasts it; every rank waits at a
    barrier. Rank 1 may die right before the barrier, while rank 0 already waits there."""
    from elastic_train.collective import barrier, broadcast_from_rank_zero

    ctx = train.get_context()
    checkpoint = train.get_checkpoint()
    start = checkpoint.to_dict()["step"] if checkpoint is not None else 0
    for step in range(start + 1, config["steps"] + 1):
        plan = broadcast_from_rank_zero({"step": step, "generation": ctx.get_generation()}
                                        if ctx.get_world_rank() == 0 else None)
        if step == config.get("die_at") and ctx.get_world_rank() == 1 and once(config):
            os._exit(1)
        barrier()
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), step=step, plan=plan, pid=os.getpid(),
                     generation=ctx.get_generation())
        train.report({"step": step}, checkpoint=train.Checkpoint.from_dict({"step": step})
                     if ctx.get_world_rank() == 0 else None)
    return {"rank": ctx.get_world_rank(), "steps": config["steps"]}


@pytest.mark.timeout(120)
def test_broadcast_from_rank_zero_and_barrier_and_the_return_value(local_ray, run_dirs):
    result = _run(run_dirs, collective_loop, steps=3)
    progress = read_progress(run_dirs["log_dir"])
    assert sorted((p["rank"], p["step"]) for p in progress) == [(r, s) for r in (0, 1) for s in (1, 2, 3)]
    assert all(p["plan"] == {"step": p["step"], "generation": p["generation"]} for p in progress)
    assert result.return_value == {"rank": 0, "steps": 3}  # rank 0's, as Ray Train V2
    assert train.Result.from_path(result.path).return_value is None  # nothing in the folder is unpickled


@pytest.mark.timeout(180)
def test_a_rank_lost_while_its_peer_waits_at_a_barrier_unwinds_the_peer_in_place(local_ray, run_dirs):
    result = _run(run_dirs, collective_loop, steps=6, die_at=3)
    progress = read_progress(run_dirs["log_dir"])
    # Rank 0 waited at the barrier of step 3 for a dead peer: it was answered, kept its process, and
    # the loop went on in the next generation from the checkpoint of step 2.
    assert sorted({p["step"] for p in progress if p["rank"] == 0}) == [1, 2, 3, 4, 5, 6]
    assert len({p["pid"] for p in progress if p["rank"] == 0}) == 1
    assert [h["step"] for h in result.metrics_history] == [1, 2, 3, 4, 5, 6]
    assert all(p["plan"] == {"step": p["step"], "generation": p["generation"]} for p in progress)
    assert max(p["generation"] for p in progress) > min(p["generation"] for p in progress)
    assert result.return_value == {"rank": 0, "steps": 6}


def reports_its_run_folder(config):
    """Seed 001's workflow 4, path fixed: it writes into the run's own folder and reports that."""
    trial_dir = train.get_context().get_trial_dir()
    torch.save({"epoch": 0}, os.path.join(trial_dir, "model.pt"))
    train.report({"loss": 1.0}, checkpoint=Checkpoint.from_directory(trial_dir))


@pytest.mark.timeout(120)
def test_reporting_the_runs_own_folder_as_a_checkpoint_fails_clearly(local_ray, run_dirs):
    with pytest.raises(train.WorkerGroupError, match=r"holds the run's own folder .*TemporaryDirectory"):
        _run(run_dirs, reports_its_run_folder, num_workers=1)
    assert Path(run_dirs["storage"], "run", "run.json").exists()  # what the run had saved is kept


@pytest.mark.timeout(10)
def test_a_return_value_that_cannot_travel_fails_clearly_and_one_that_cannot_load_is_none(caplog):
    import threading as _threading

    from elastic_train.driver.outcome import returned
    from elastic_train.protocol import Outcome

    with pytest.raises(TypeError, match=r"returned a lock, which cannot be pickled: return a picklable value"):
        Outcome.finished(0, _threading.Lock())
    assert Outcome.finished(0, None).returned is None
    assert returned(Outcome.finished(0, {"acc": 0.9}).returned) == {"acc": 0.9}
    assert returned(b"not a pickle") is None and "could not be loaded here" in caplog.text
