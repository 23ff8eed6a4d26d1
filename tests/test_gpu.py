"""The NCCL path. Needs GPUs; skips cleanly on machines without them."""

from __future__ import annotations

import pytest
import torch

import elastic_train as et
from tests.loops import linear_regression_loop

gpus = torch.cuda.device_count()


@pytest.mark.timeout(180)
@pytest.mark.skipif(gpus < 1, reason="needs a GPU")
def test_nccl_worker_trains_on_its_gpu(run_dirs):
    import ray

    from tests.conftest import ray_runtime_env

    ray.init(num_gpus=gpus, runtime_env=ray_runtime_env())
    try:
        result = et.TorchTrainer(
            linear_regression_loop,
            train_loop_config={"steps": 10, "log_dir": run_dirs["log_dir"]},
            scaling_config=et.ScalingConfig(num_workers=1, use_gpu=True),
            run_config=et.RunConfig(storage_path=run_dirs["storage"], name="run"),
        ).fit()
    finally:
        ray.shutdown()
    assert result.error is None, result.error
    assert result.metrics["step"] == 10


@pytest.mark.timeout(240)
@pytest.mark.skipif(gpus < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_sigkill_of_rank_1_recovers_in_place(run_dirs):
    import ray

    from tests.conftest import ray_runtime_env

    ray.init(num_gpus=2, num_cpus=4, runtime_env=ray_runtime_env())
    try:
        result = et.TorchTrainer(
            linear_regression_loop,
            train_loop_config={"steps": 40, "log_dir": run_dirs["log_dir"], "step_time": 0.1,
                               "fault": {"kind": "kill", "rank": 1, "at_step": 10}},
            scaling_config=et.ScalingConfig(num_workers=(1, 2), use_gpu=True),
            run_config=et.RunConfig(storage_path=run_dirs["storage"], name="run"),
        ).fit()
    finally:
        ray.shutdown()
    assert result.error is None, result.error
    assert result.metrics["step"] == 40
    assert 1 in result.world_sizes
