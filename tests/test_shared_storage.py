"""A local `storage_path` on a cluster whose machines do not share it: every worker would write its
checkpoint parts to its own disk. The run must fail at start, saying so, never split a checkpoint.

The second machine is real as far as the run can tell: a Ray node started with the `ray start` CLI
in a mount namespace of its own, where a fresh tmpfs covers the storage path (its own disk there).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import elastic_train as et
from tests.conftest import ray_runtime_env, stop_ray
from tests.helpers import make_trainer, wait_for

RAY = str(Path(sys.executable).parent / "ray")


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a mount namespace of its own needs root and unshare (util-linux)")
def test_a_worker_whose_machine_has_its_own_disk_at_storage_path_fails_the_run_clearly(run_dirs):
    storage = Path(run_dirs["storage"])
    storage.mkdir()
    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    machine = subprocess.Popen(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs tmpfs '{storage}' && exec '{RAY}' start --address={cluster.address} --num-cpus=1 --block"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ray.init(address=cluster.address, runtime_env=ray_runtime_env())
        wait_for(lambda: ray.cluster_resources().get("CPU") == 2, 60, "the second machine to join")
        with pytest.raises(et.ControllerError, match=r"does not see this run's files .*storage every node shares"):
            make_trainer(run_dirs, 2, steps=20, step_time=0.05).fit()
        assert (storage / "run" / "run.json").exists()  # what the driver saved is kept
    finally:
        ray.shutdown()
        os.killpg(machine.pid, signal.SIGTERM)
        try:
            machine.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(machine.pid, signal.SIGKILL)
            machine.wait()
        cluster.shutdown()
