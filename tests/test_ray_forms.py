"""What Ray Train code hands elastic_train in Ray's own forms, found by running Ray's own tests
(tests/ray_conformance): pyarrow filesystems, URIs with pyarrow's options in their query, Ray's
`Checkpoint` objects, local mode (`num_workers=0`), `DataParallelTrainer`, V2's module paths and the
deprecated `TorchCheckpoint`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow.fs
import pytest
import ray.train
import torch
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

import elastic_train as train
from elastic_train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from elastic_train.checkpoint.filesystems import as_fsspec, split_query
from elastic_train.checkpoint.manifest import MANIFEST
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ConfigError
from elastic_train.torch import TorchTrainer


@pytest.mark.timeout(10)
def test_a_uri_in_pyarrows_form_has_its_query_read_as_s3fs_options():
    url, options = split_query("s3://bucket/prefix?region=us-west-2&endpoint_override=http://127.0.0.1:5002", {})
    assert url == "s3://bucket/prefix"
    assert options == {"client_kwargs": {"region_name": "us-west-2"}, "endpoint_url": "http://127.0.0.1:5002"}
    _, options = split_query("s3://b?endpoint_override=127.0.0.1:9&scheme=http&access_key=k&secret_key=s",
                             {"key": "mine"})
    assert options == {"endpoint_url": "http://127.0.0.1:9", "key": "mine", "secret": "s"}  # given ones win
    with pytest.raises(ConfigError, match="check_ssl in the URL's query is not understood here"):
        split_query("s3://b?check_ssl=1", None)
    with pytest.raises(ConfigError, match="understood for s3:// only"):
        split_query("gs://b?endpoint_override=x", None)
    assert split_query("/local/path?odd", None) == ("/local/path?odd", {})
    assert split_query("https://host/data?sig=abc", {"x": 1}) == ("https://host/data?sig=abc", {"x": 1})


@pytest.mark.timeout(60)
def test_a_run_stored_at_a_uri_in_pyarrows_form_is_read_back_from_it(s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    uri = f"{s3_bucket['url']}?region=us-east-1&endpoint_override={s3_bucket['endpoint']}"
    storage = RunStorage(uri, "run")
    storage.write_part(1, {"model.pt": b"weights"})
    assert storage.url() == f"{s3_bucket['url']}/run"
    assert RunStorage.at(f"{s3_bucket['url']}/run?region=us-east-1&endpoint_override={s3_bucket['endpoint']}/"
                         ).fs.cat_file(f"{s3_bucket['url'][5:]}/run/checkpoint_000001_g0000/model.pt") == b"weights"


@pytest.mark.timeout(10)
def test_pyarrow_filesystems_are_taken_and_checkpoints_print_as_rays(tmp_path):
    wrapped = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(DirFileSystem(path=str(tmp_path), fs=LocalFileSystem())))
    assert isinstance(as_fsspec(wrapped), DirFileSystem)
    assert as_fsspec(pyarrow.fs.LocalFileSystem()).protocol[0] == "file"
    with pytest.raises(ConfigError, match="pyarrow.fs.FileSystem or an fsspec filesystem, got str"):
        RunConfig(storage_path="x", storage_filesystem="s3")
    config = RunConfig(storage_filesystem=wrapped)  # as Ray takes it: the default storage root, on that filesystem
    storage = RunStorage(config.resolved_storage_path(), "run", filesystem=config.storage_filesystem)
    storage.write_part(1, {"model.pt": b"weights"})
    assert (tmp_path / config.resolved_storage_path().lstrip("/") / "run" / "checkpoint_000001_g0000").is_dir()
    assert repr(Checkpoint("/bucket/ckpt")) == "Checkpoint(filesystem=local, path=/bucket/ckpt)"
    assert repr(Checkpoint("b/ckpt", wrapped)) == "Checkpoint(filesystem=dir, path=b/ckpt)"
    result = train.Result(metrics={"iter": 0}, checkpoint=Checkpoint("/b/c"), error=None, path="/b")
    assert "Checkpoint(filesystem=local, path=/b/c)" in repr(result) and "metrics={'iter': 0}" in repr(result)
    with pytest.raises(TypeError, match="must be an elastic_train.Checkpoint, got str"):
        Checkpoint.from_ray("/a/path")


@pytest.mark.timeout(10)
def test_data_parallel_trainer_and_rays_v2_module_paths():
    from elastic_train.v2.api.config import RunConfig as V2RunConfig
    from elastic_train.v2.api.data_parallel_trainer import DataParallelTrainer
    from elastic_train.v2.api.exceptions import WorkerGroupError
    from elastic_train.v2.api.result import Result

    assert (V2RunConfig, Result, WorkerGroupError) == (RunConfig, train.Result, train.WorkerGroupError)
    assert DataParallelTrainer is train.DataParallelTrainer and issubclass(TorchTrainer, DataParallelTrainer)
    trainer = DataParallelTrainer(lambda: None, backend_config=train.BackendConfig())
    assert trainer.scaling_config.num_workers == 1 and isinstance(trainer.backend_config, train.BackendConfig)
    with pytest.raises(ConfigError, match="torch_config must be an elastic_train.torch.TorchConfig, got BackendConfig"):
        TorchTrainer(lambda: None, torch_config=train.BackendConfig())


@pytest.mark.timeout(30)
def test_every_module_of_rays_v2_api_has_ours():
    """Ray's own test utilities import from them (ray.train.v2.api.validation_config, say)."""
    import importlib
    import pkgutil

    import ray.train.v2.api

    for module in pkgutil.iter_modules(ray.train.v2.api.__path__):
        if not module.name.startswith("_"):
            ours = importlib.import_module(f"elastic_train.v2.api.{module.name}")
            rays = importlib.import_module(f"ray.train.v2.api.{module.name}")
            public = [n for n in getattr(rays, "__all__", ()) if not n.startswith("_")]
            assert all(hasattr(ours, n) for n in public), (module.name, [n for n in public if not hasattr(ours, n)])
    from elastic_train.v2.api.validation_config import ValidationTaskConfig

    with pytest.raises(train.UnsupportedAPIError, match="checkpoint validation is not supported"):
        ValidationTaskConfig()
    from elastic_train.v2.torch.torchft_config import TorchftConfig

    with pytest.raises(train.UnsupportedAPIError, match="without torchft's replica groups"):
        TorchftConfig(lighthouse_kwargs={})


def rays_forms_loop(config):
    """Ray's checkpoint objects (what Ray's own helpers make) reported, in local mode."""
    ctx = train.get_context()
    for step in range(1, 4):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            train.report({"step": step, "cwd": os.getcwd(), "size": ctx.get_world_size()},
                         checkpoint=ray.train.Checkpoint.from_directory(folder))


@pytest.mark.timeout(120)
def test_a_run_on_a_pyarrow_filesystem_in_local_mode_reporting_rays_checkpoints(local_ray, tmp_path, monkeypatch):
    """Ray's persistence test's custom filesystem (a folder under a pyarrow wrapper), num_workers=0 (Ray's
    local mode: one worker here), Ray's Checkpoint objects, RAY_CHDIR_TO_TRIAL_DIR=0 (the loop stays in
    the worker's own directory), and the best checkpoint kept alone: its folder on that filesystem."""
    monkeypatch.setenv("RAY_CHDIR_TO_TRIAL_DIR", "0")
    fs = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(DirFileSystem(path=str(tmp_path), fs=LocalFileSystem())))
    result = TorchTrainer(
        rays_forms_loop, scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name="forms", storage_path="bucket", storage_filesystem=fs,
                             checkpoint_config=CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="step")),
    ).fit()
    assert result.metrics["step"] == 3 and result.metrics["size"] == 1
    assert ray.is_initialized()  # the instance the test started is the test's: left running
    assert "working_dirs" not in result.metrics["cwd"]
    assert result.path == "bucket/forms" and result.checkpoint.path.startswith("bucket/forms/")
    with result.checkpoint.as_directory() as folder:
        assert Path(folder, "step.txt").read_text() == "3"
    kept = [p.name for p in (tmp_path / "bucket" / "forms").iterdir() if p.name.startswith("checkpoint_")]
    assert kept == [Path(result.checkpoint.path).name]  # retention removed the others, folders too
    again = train.Result.from_path(result.path, fs)
    assert again.metrics["step"] == 3 and again.checkpoint.path == result.checkpoint.path
    # restore() on that filesystem goes on with the run; its trainer.pkl keeps no filesystem object.
    assert TorchTrainer.can_restore(result.path, fs) and not TorchTrainer.can_restore("bucket/none", fs)
    restored = TorchTrainer.restore(result.path, storage_filesystem=fs)
    assert restored.run_config.storage_filesystem is fs and restored.run_config.storage_path == "bucket"
    # storage_options once came second, positionally: still read as such, with a warning.
    with pytest.warns(DeprecationWarning, match="pass storage_options=... by name"):
        assert train.Result.from_path(str(tmp_path / "bucket" / "forms"), {}).metrics["step"] == 3


@pytest.mark.timeout(120)
def test_local_mode_leaves_no_ray_instance_it_started(no_ray, tmp_path):
    """Ray's local mode (`num_workers=0`) runs the loop without Ray; here it runs in one worker on a Ray
    instance that fit() starts, and stops again: a later `ray.init()` works, as after Ray's."""
    result = TorchTrainer(rays_forms_loop, scaling_config=ScalingConfig(num_workers=0),
                          run_config=RunConfig(name="local", storage_path=str(tmp_path))).fit()
    assert result.metrics["step"] == 3
    assert not ray.is_initialized()
    ray.init(num_cpus=1, include_dashboard=False)
    ray.shutdown()


@pytest.mark.timeout(30)
def test_torch_checkpoint_holds_a_model_or_its_state_dict_as_rays_does(tmp_path):
    """Ray's deprecated TorchCheckpoint, with its warnings: a state dict (DDP's `module.` prefix dropped)
    loaded into the model given, a whole model unpickled, a preprocessor in the metadata."""
    from elastic_train.torch import TorchCheckpoint

    model = torch.nn.Linear(2, 1)
    with pytest.warns(DeprecationWarning, match="`TorchCheckpoint` is deprecated"):
        saved = TorchCheckpoint.from_state_dict({f"module.{k}": v for k, v in model.state_dict().items()},
                                                preprocessor={"scale": 2})
    loaded = saved.get_model(torch.nn.Linear(2, 1))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert saved.get_preprocessor() == {"scale": 2} and isinstance(saved, Checkpoint)
    with pytest.raises(ValueError, match="no `model_definition` was provided"):
        saved.get_model()
    with pytest.warns(DeprecationWarning, match=r"from_model\(\)` is deprecated"):
        whole = TorchCheckpoint.from_model(model)
    again = TorchCheckpoint.from_directory(whole.path)
    assert torch.equal(again.get_model().weight, model.weight) and again.get_preprocessor() is None
    (tmp_path / "other").mkdir()
    with pytest.raises(RuntimeError, match="`model.pt` not found within this checkpoint"):
        TorchCheckpoint.from_directory(tmp_path / "other").get_model()


def torch_checkpoint_loop() -> None:
    from elastic_train.torch import TorchCheckpoint, prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(2, 1))
    train.report({"done": 1}, checkpoint=TorchCheckpoint.from_state_dict(model.state_dict()))


@pytest.mark.timeout(120)
def test_a_torch_checkpoint_reported_from_a_ddp_model_loads_into_a_plain_one(local_ray, tmp_path):
    from elastic_train.torch import TorchCheckpoint

    result = TorchTrainer(torch_checkpoint_loop, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="torch_checkpoint", storage_path=str(tmp_path))).fit()
    torch.manual_seed(0)
    expected = torch.nn.Linear(2, 1)
    loaded = TorchCheckpoint.from_directory(result.checkpoint.path).get_model(torch.nn.Linear(2, 1))
    assert torch.equal(loaded.weight, expected.weight) and torch.equal(loaded.bias, expected.bias)
    # A stored checkpoint's folder, opened as Ray users open one, is read through its manifest: verified.
    Path(result.checkpoint.path, TorchCheckpoint.MODEL_FILENAME).write_bytes(b"torn")
    with pytest.raises(train.CheckpointError):
        TorchCheckpoint.from_directory(result.checkpoint.path).get_model(torch.nn.Linear(2, 1))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / MANIFEST).write_text("my own notes")
    with pytest.raises(train.CheckpointError, match="is the name elastic_train gives its commit record, and this one is "
                                                    "not"):
        Checkpoint.from_directory(tmp_path / "mine")


@pytest.mark.timeout(10)
def test_run_config_defaults_and_rays_v1_configs_as_ray_v2_has_them():
    """RunConfig() holds default Checkpoint and Failure configs, not None; Ray's V1 configs (ray.air's,
    named alike) are refused, naming ours."""
    import ray.air

    config = RunConfig()
    assert type(config.failure_config) is train.FailureConfig and type(config.checkpoint_config) is CheckpointConfig
    with pytest.raises(ValueError, match=r"scaling_config must be an elastic_train\.ScalingConfig .*got ray\.air\."):
        TorchTrainer(lambda: None, scaling_config=ray.air.ScalingConfig())
    with pytest.raises(ValueError, match=r"use `elastic_train\.RunConfig` instead"):
        TorchTrainer(lambda: None, run_config=ray.air.RunConfig())
    with pytest.raises(ValueError, match=r"RunConfig\.failure_config must be an elastic_train\.FailureConfig"):
        RunConfig(failure_config=ray.air.FailureConfig())
