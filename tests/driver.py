"""A run in a driver process of its own, so that a test can SIGKILL the driver.

    python -m tests.driver '{"address": ..., "storage": ..., "options": {...}, "workers": 4, "config": {...}}'

"loop" names another loop of tests/loops.py than `large_shard_loop`.
"""

from __future__ import annotations

import json
import os
import sys

import ray

import elastic_train as et
from tests.conftest import ray_runtime_env
from tests import loops


def main() -> None:
    args = json.loads(sys.argv[1])
    # Storage credentials and endpoint come from the standard AWS environment variables, handed on to
    # the run's actors as a user would.
    runtime_env = ray_runtime_env()
    runtime_env["env_vars"].update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    ray.init(address=args["address"], runtime_env=runtime_env)
    et.TorchTrainer(
        getattr(loops, args.get("loop", "large_shard_loop")),
        train_loop_config=args["config"],
        scaling_config=et.ScalingConfig(num_workers=args["workers"], resources_per_worker={"CPU": 0.5}),
        run_config=et.RunConfig(storage_path=args["storage"], name=args["name"]),
    ).fit()


if __name__ == "__main__":
    main()
