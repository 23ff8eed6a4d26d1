"""Bad input fails in the driver, before any actor starts, naming the problem and the fix."""

from __future__ import annotations

import time

import pytest
import ray

import elastic_train as et
from elastic_train.driver.arguments import as_config


def loop(config):
    pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: et.ScalingConfig(num_workers=(3, 2)), r"min 3 is greater than max 2; write num_workers=\(2, 3\)"),
        (lambda: et.ScalingConfig(num_workers=-1), r"need a number of workers \(0: Ray's local mode"),
        (lambda: et.ScalingConfig(num_workers=(0, 2)), "min must be at least 1"),
        (lambda: et.ScalingConfig(num_workers=(1, 2, 3)), r"a \(min, max\) pair"),
        (lambda: et.ScalingConfig(placement_strategy="RANDOM"), "use one of PACK"),
        (lambda: et.ScalingConfig(num_workers=(1, 3), label_selector=[{"a": "b"}] * 2),
         "If `label_selector` is a list, it must be the same length as `max_workers`"),
        (lambda: et.ScalingConfig(label_selector={"zone": 1}), "give a dict of label values"),
        (lambda: et.ScalingConfig(label_selector={"pool": "in(a"}), r"Invalid label selector value `in\(a`"),
        (lambda: et.TorchTrainer(42), "train_loop_per_worker must be a function"),
        (lambda: et.TorchTrainer(loop(None)), "not train_func()"),
        (lambda: et.TorchTrainer(loop, scaling_config={"num_workers": 2, "num_worker": 3}),
         r"ScalingConfig has no option 'num_worker' \(did you mean 'num_workers'\?\); known options: .*num_workers"),
        (lambda: et.TorchTrainer(loop, run_config={"storage": "/tmp"}), "RunConfig has no option 'storage'"),
        (lambda: et.TorchTrainer(loop, train_loop_config=[1]), "train_loop_config must be a dict"),
        (lambda: et.TorchTrainer(lambda: None, train_loop_config={"a": 1}), "add a `config` parameter"),
        (lambda: et.FailureConfig(max_failures=-2), "-1 for no limit"),
        (lambda: et.CheckpointConfig(checkpoint_score_order="lowest"), "use 'max' or 'min'"),
        (lambda: et.ElasticConfig(heartbeat_timeout_s=0.5), "must exceed twice"),
        (lambda: et.ElasticConfig(heartbeat_reply_timeout_s=0.4),
         r"heartbeat_reply_timeout_s=0.4 must exceed heartbeat_interval_s=0.5 .*or set heartbeat_udp=False"),
        (lambda: et.ElasticConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=1.5),
         r"stay below heartbeat_timeout_s - 2 \* heartbeat_interval_s = 1 "),
        (lambda: et.ElasticConfig(probe_timeout_s=0), "must be a positive number of seconds"),
        (lambda: et.ElasticConfig(snapshot_memory_retain_mb=0), "or None to keep the allocator"),
        (lambda: et.ElasticConfig(warm_spares_per_node=-1), "warm_spares_per_node=-1: use a whole number >= 0"),
        (lambda: et.ElasticConfig(warm_spares_after_s=-1.0), "warm_spares_after_s must be 0 \\(no wait\\) or a positive"),
        (lambda: et.ElasticConfig(drain_timeout_s=10, rendezvous_timeout_s=30),
         "drain_timeout_s=10 must exceed rendezvous_timeout_s=30.*Raise drain_timeout_s"),
        (lambda: et.ElasticConfig(progress_timeout_s=0), "progress_timeout_s must be a positive number"),
        (lambda: et.ElasticConfig(part_safe_wait_s=-1), r"part_safe_wait_s must be 0 \(no wait\) or a positive number"),
        (lambda: et.ElasticConfig(process_group_destroy_timeout_s=25), "must be below rendezvous_timeout_s=20"),
        (lambda: et.ElasticConfig(progress_timeout_s=0.2),
         r"report_interval_s=0.25 must be below progress_timeout_s=0.2: the watchdog would take"),
        (lambda: et.RunConfig(failure_config=et.CheckpointConfig()),
         r"must be an elastic_train.FailureConfig, got elastic_train.config.run.CheckpointConfig: use "),
    ],
)
def test_bad_input_is_rejected_before_any_actor_starts(no_ray, make, message):
    with pytest.raises(et.ConfigError, match=message):
        make()
    assert not ray.is_initialized()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls, old, new, value", [
    (et.CheckpointConfig, "persist_every_n_reports", "store_every_n_reports", 3),
    (et.CheckpointConfig, "persist_interval_s", "store_interval_s", 9.0),
    (et.ElasticConfig, "persist_flush_timeout_s", "store_flush_timeout_s", 60.0),
])
@pytest.mark.parametrize("given_as", ["object", "dict"])
def test_a_renamed_field_keeps_its_meaning_with_a_deprecation_warning(no_ray, cls, old, new, value, given_as):
    """A config written before a field was renamed (one word per concept: "store") means what it
    meant, as an object or as the trainer's dict of options; the warning names the new name, and
    both names at once are refused."""
    make = (lambda **kw: cls(**kw)) if given_as == "object" else (lambda **kw: as_config(cls, kw, "config"))
    with pytest.warns(DeprecationWarning, match=rf"{old}=\.\.\.\) is now {cls.__name__}\({new}="):
        config = make(**{old: value})
    assert getattr(config, new) == value
    with pytest.raises(et.ConfigError, match=f"pass {new} alone"):
        make(**{old: value, new: value})


@pytest.mark.timeout(60)
def test_use_gpu_without_gpus_fails_fast(local_ray, run_dirs):
    trainer = et.TorchTrainer(loop, scaling_config=et.ScalingConfig(num_workers=1, use_gpu=True),
                              run_config=et.RunConfig(storage_path=run_dirs["storage"]))
    if ray.cluster_resources().get("GPU"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(et.ConfigError, match="set use_gpu=False"):
        trainer.fit()


@pytest.mark.timeout(90)
def test_a_loop_the_workers_cannot_import_fails_its_ranks_with_why(local_ray, run_dirs, tmp_path, monkeypatch):
    """As under Ray Train (which unpickles the loop in run_train_fn): a loop whose module is on the driver's
    path alone fails each rank with that error, counted as a failure, at once; not after
    min_workers_timeout_s with "could not be placed"."""
    (tmp_path / "driver_only_loop.py").write_text("def loop(config):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from driver_only_loop import loop as driver_only

    trainer = et.TorchTrainer(driver_only, train_loop_config={}, scaling_config=et.ScalingConfig(num_workers=2),
                              run_config=et.RunConfig(storage_path=run_dirs["storage"]))
    started = time.monotonic()
    with pytest.raises(et.WorkerGroupError) as caught:
        trainer.fit()
    assert time.monotonic() - started < et.ElasticConfig().min_workers_timeout_s / 2
    assert sorted(caught.value.worker_failures) == [0, 1]
    assert all(isinstance(e, ModuleNotFoundError) and e.name == "driver_only_loop"
               for e in caught.value.worker_failures.values())
