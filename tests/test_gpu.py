"""The NCCL path. Needs GPUs; skips cleanly on machines without them."""

from __future__ import annotations

import pytest
import ray
import torch

from tests.conftest import ray_runtime_env
from tests.helpers import make_trainer

gpus = torch.cuda.device_count()


@pytest.fixture
def gpu_ray():
    ray.init(num_gpus=gpus, num_cpus=max(2 * gpus, 2), runtime_env=ray_runtime_env())
    yield
    ray.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.skipif(gpus < 1, reason="needs a GPU")
def test_nccl_worker_trains_on_its_gpu(gpu_ray, run_dirs):
    result = make_trainer(run_dirs, 1, use_gpu=True, steps=10).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 10


@pytest.mark.timeout(240)
@pytest.mark.skipif(gpus < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_sigkill_of_rank_1_recovers_in_place(gpu_ray, run_dirs):
    result = make_trainer(run_dirs, (1, 2), use_gpu=True, steps=40, step_time=0.1,
                          fault={"kind": "kill", "rank": 1, "at_step": 10}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 40
    assert 1 in result.world_sizes
