"""Shared fixtures: a real local Ray instance (shared by consecutive tests), a clean storage folder per
test, a real S3 endpoint."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.helpers import wait_for

_EXIT_STATUS = pytest.StashKey[int]()

ROOT = Path(__file__).resolve().parent.parent


def ray_runtime_env() -> dict:
    """Workers import the test loops from this checkout."""
    return {"env_vars": {"PYTHONPATH": str(ROOT)}}


# The shared local instance's workers inherit this process's environment: with no runtime env of its
# own, an actor starts in one of Ray's idle worker processes (~0.4 s sooner than one made for the env).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


RAY_DATA_ACTORS = ("_dataset_stats_actor", "AutoscalingCoordinator")  # Ray Data's own, for the instance's life
RAY_RELEASE_TIMEOUT_S = 60.0  # how long a test's run may take to give back what it held on the shared instance
_shared_cpus: int | None = None  # the CPUs of the shared local instance while it runs


def start_ray(num_cpus: int) -> None:
    """Connect to a local Ray instance of `num_cpus` CPUs: the shared one when it has that many, else
    a fresh one. Starting Ray takes seconds and most tests need the same instance, so consecutive
    tests share it; `release_ray()` checks that each left it as it found it."""
    global _shared_cpus
    if ray.is_initialized() and _shared_cpus == num_cpus:
        return
    stop_ray()
    ray.init(num_cpus=num_cpus, include_dashboard=False)
    _shared_cpus = num_cpus


def release_ray() -> None:
    """End a test on the shared instance: its run must have given back every CPU and ended every named
    actor (its supervisor) - else the library leaked them, the test fails, and the instance is
    replaced so that the next test starts clean."""
    def leftovers() -> tuple[float, list]:
        held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
        return held, [a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] not in RAY_DATA_ACTORS]

    try:
        wait_for(lambda: leftovers() == (0, []), RAY_RELEASE_TIMEOUT_S, "the run to give back its CPUs and actors")
    except AssertionError:
        held, named = leftovers()
        stop_ray()
        pytest.fail(f"the test's run left {held:g} CPUs held and named actors {named} alive "
                    f"{RAY_RELEASE_TIMEOUT_S:g}s after it ended")


def stop_ray() -> None:
    """Shut down whatever Ray this process is connected to (before a test starts its own)."""
    global _shared_cpus
    ray.shutdown()
    _shared_cpus = None


@pytest.fixture
def local_ray():
    """A 2-CPU Ray instance on this machine, shared by consecutive tests (see `start_ray`)."""
    start_ray(2)
    yield
    release_ray()


@pytest.fixture
def data_ray():
    """A local Ray instance of 4 CPUs: 2 for the workers, 2 for Ray Data's tasks (see `start_ray`)."""
    start_ray(4)
    yield
    release_ray()


@pytest.fixture
def no_ray():
    """No Ray instance in this process: for tests that check something is done without starting one."""
    stop_ray()


@pytest.fixture
def three_node_cluster():
    """A simulated cluster: a head with 0 CPUs and 3 nodes of 1 CPU each; yields (cluster, nodes)."""
    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env())
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def run_dirs(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    return {"log_dir": str(log_dir), "storage": str(tmp_path / "storage")}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint on 127.0.0.1: moto's server, as s3fs's own tests use."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_options(endpoint: str) -> dict:
    """s3fs options for a test endpoint; retries are ours (tenacity), so botocore's are off (its own
    backoff would only add waiting)."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 0}, "connect_timeout": 5, "read_timeout": 20},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the S3 endpoint: `{"url": "s3://<bucket>", "options": <storage_options>}`."""
    import boto3

    options = s3_options(s3_server)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return {"url": f"s3://{bucket}", "options": options, "endpoint": s3_server}


def pytest_configure(config):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with the suite's status once pytest is done. Two of three full runs on
    2026-11-26 passed every test, then segfaulted in process teardown (C++ destructors, after Python's
    own finalization: its fault handler printed nothing), so the status said "failed" for a green
    suite. Skipping that teardown changes no test's outcome; the cause is an open item of issue 14."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash.get(_EXIT_STATUS, 1))
