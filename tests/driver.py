"""A run in a driver process of its own, so that a test can SIGKILL the driver.

    python -m tests.driver '{"address": ..., "storage": ..., "options": {...}, "workers": 4, "config": {...}}'
"""

from __future__ import annotations

import json
import sys

import ray

import elastic_train as et
from tests.conftest import ray_runtime_env
from tests.loops import large_shard_loop


def main() -> None:
    args = json.loads(sys.argv[1])
    ray.init(address=args["address"], runtime_env=ray_runtime_env())
    et.TorchTrainer(
        large_shard_loop,
        train_loop_config=args["config"],
        scaling_config=et.ScalingConfig(num_workers=args["workers"], resources_per_worker={"CPU": 0.5}),
        run_config=et.RunConfig(storage_path=args["storage"], name=args["name"], storage_options=args["options"]),
    ).fit()


if __name__ == "__main__":
    main()
