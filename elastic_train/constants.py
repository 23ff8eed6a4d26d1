"""`ray.train.constants`: the environment variables of Ray Train's that elastic_train reads."""

from __future__ import annotations

import os
import tempfile

RAY_CHDIR_TO_TRIAL_DIR = "RAY_CHDIR_TO_TRIAL_DIR"
"""Set to "0" in the driver's environment to have each worker's loop run in the worker's own current
directory instead of the run's working directory (worker/loop/context.py `working_dir`)."""


TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"
"""Seconds a generation's torch process group is given to be torn down before a worker goes on
without it, where the driver's environment sets it: `ElasticConfig.process_group_destroy_timeout_s`
(0: do not wait)."""


def torch_shutdown_timeout_s() -> float | None:
    """`TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S` as the driver's environment sets it, else None."""
    value = os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
    return float(value) if value else None


def working_dirs_root() -> str:
    """The folder holding each run's working directory on a machine (Ray's holds `<run name>`, ours
    `<run name>_<hash of its storage folder>`: two runs of one name never share one)."""
    return os.path.join(tempfile.gettempdir(), "elastic_train", "working_dirs")


_get_ray_train_session_dir = working_dirs_root  # Ray's name for it


def chdir_to_trial_dir() -> bool:
    """Does the loop run in the run's working directory (the default, as in Ray)? Read in the driver."""
    return os.environ.get(RAY_CHDIR_TO_TRIAL_DIR, "1") != "0"
