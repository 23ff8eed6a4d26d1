"""Storage faults: transient S3 faults (errors, dropped connections, latency; injected by a proxy in
front of the S3 endpoint) are retried; slow storage makes reports wait rather than drop a
checkpoint (or, under a cadence the user chose, delays persistence, not training); a permanent
fault fails the run with a clear error; nothing committed is lost either way."""

from __future__ import annotations

import dataclasses

import pytest

import elastic_train as et
from chaos.storage_proxy import FaultyStorageProxy, StorageFaults
from elastic_train.checkpoint import list_checkpoints, verify_checkpoint
from tests.helpers import fit_in_background, wait_for
from tests.loops import sharded_directory_loop

UPLOADS = frozenset({"PUT", "POST"})


class LastReport(et.UserCallback):
    def after_report(self, run_context, metrics, checkpoint):
        self.metrics = metrics[0]


@pytest.fixture
def proxy(s3_bucket):
    with FaultyStorageProxy(s3_bucket["endpoint"], seed=7) as running:
        yield running


def _trainer(run_dirs: dict, s3_bucket: dict, proxy: FaultyStorageProxy, steps: int, step_time: float,
             checkpoint_config: et.CheckpointConfig | None = None, **elastic) -> et.TorchTrainer:
    return et.TorchTrainer(
        sharded_directory_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "steps": steps, "step_time": step_time},
        scaling_config=et.ScalingConfig(num_workers=2),
        run_config=et.RunConfig(
            storage_path=s3_bucket["url"], name="run",
            storage_options={**s3_bucket["options"], "endpoint_url": proxy.url},
            checkpoint_config=checkpoint_config, elastic_config=et.ElasticConfig(**elastic),
        ),
    )


def _whole_checkpoints(result: et.Result, s3_bucket: dict) -> list[int]:
    committed = list_checkpoints(result.path, s3_bucket["options"])
    for checkpoint in committed:
        assert verify_checkpoint(result.path, checkpoint.index, s3_bucket["options"]) == []
    return [c.index for c in committed]


@pytest.mark.timeout(240)
def test_transient_storage_faults_are_retried_and_training_completes(local_ray, run_dirs, s3_bucket, proxy):
    proxy.set_faults(StorageFaults(error_rate=0.3, error_status=503, drop_rate=0.1, latency_s=0.05, methods=UPLOADS))
    # Backoffs of at most 1 s: four requests in ten fail here, and the default (up to 10 s) only adds waiting.
    result = _trainer(run_dirs, s3_bucket, proxy, steps=20, step_time=0.05, storage_retry_initial_s=0.05,
                      storage_retry_max_s=1.0).fit()
    proxy.clear()
    assert result.error is None, result.error
    assert [h["step"] for h in result.metrics_history] == list(range(1, 21))
    assert proxy.stats["faults"].get("error", 0) > 0 and proxy.stats["faults"].get("drop", 0) > 0, proxy.stats
    committed = _whole_checkpoints(result, s3_bucket)
    assert committed[-1] == 20, committed  # the final checkpoint reached storage before fit() returned
    with result.checkpoint.as_directory() as d, open(f"{d}/shard_1.txt") as f:
        assert f.read() == "20"


@pytest.mark.timeout(240)
def test_slow_storage_stores_every_checkpoint_and_reports_wait_for_room(local_ray, run_dirs, s3_bucket, proxy):
    """Ray's contract, the default: no reported checkpoint is dropped. Storage slower than the steps
    makes reports wait (memory stays bounded), and the waits are events."""
    proxy.set_faults(StorageFaults(latency_s=0.3, methods=UPLOADS))
    result = _trainer(run_dirs, s3_bucket, proxy, steps=8, step_time=0.02).fit()
    assert [h["step"] for h in result.metrics_history] == list(range(1, 9))
    assert _whole_checkpoints(result, s3_bucket) == list(range(1, 9))
    assert [e for e in result.events if e["kind"] == "report_waited_for_upload"], "no report waited"


@pytest.mark.timeout(240)
def test_slow_storage_under_a_cadence_delays_persistence_not_training(local_ray, run_dirs, s3_bucket, proxy):
    """A cadence (`store_every_n_reports`) opts out of storing every checkpoint: then reports never
    wait for uploads, and a chosen checkpoint still waiting is replaced by a newer one."""
    proxy.set_faults(StorageFaults(latency_s=1.0, methods=UPLOADS))
    result = _trainer(run_dirs, s3_bucket, proxy, steps=30, step_time=0.05,
                      checkpoint_config=et.CheckpointConfig(store_every_n_reports=1)).fit()
    assert [h["step"] for h in result.metrics_history] == list(range(1, 31))
    committed = _whole_checkpoints(result, s3_bucket)
    # Reports did not wait for uploads: while one checkpoint was on its way, newer ones lived in
    # memory only; the last one was flushed at the end.
    assert committed[-1] == 30 and len(committed) < 15, committed
    assert not [e for e in result.events if e["kind"] == "report_waited_for_upload"]


@pytest.mark.timeout(240)
def test_a_permanent_storage_fault_fails_clearly_and_keeps_what_was_committed(local_ray, run_dirs, s3_bucket, proxy):
    trainer = _trainer(run_dirs, s3_bucket, proxy, steps=10_000, step_time=0.05)
    last = LastReport()
    trainer.run_config = dataclasses.replace(trainer.run_config, callbacks=[last])
    join = fit_in_background(trainer)
    run = f"{s3_bucket['url']}/run"
    before = wait_for(lambda: len(c := list_checkpoints(run, s3_bucket["options"])) >= 2 and c, 120,
                      "two committed checkpoints")
    proxy.set_faults(StorageFaults(outage_status=403, methods=UPLOADS))
    with pytest.raises(et.ControllerError) as caught:
        join(120)
    proxy.clear()
    assert "PermissionError" in str(caught.value) and "credentials" in str(caught.value), caught.value
    assert proxy.stats["faults"].get("outage", 0) > 0
    after = _whole_checkpoints(et.Result.from_path(run, storage_options=s3_bucket["options"]), s3_bucket)
    assert {c.index for c in before} <= set(after)
    assert last.metrics["step"] > before[-1].index  # training went on until the outage
