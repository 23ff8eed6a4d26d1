"""Shared fixtures: a real local Ray instance, and a clean storage folder per test."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parent.parent


def ray_runtime_env() -> dict:
    """Workers import the test loops from this checkout."""
    return {"env_vars": {"PYTHONPATH": str(ROOT)}}


@pytest.fixture
def local_ray():
    """A fresh 2-CPU Ray instance on this machine."""
    ray.init(num_cpus=2, runtime_env=ray_runtime_env(), include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def three_node_cluster():
    """A simulated cluster: a head with 0 CPUs and 3 nodes of 1 CPU each; yields (cluster, nodes)."""
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
    """s3fs options for a test endpoint; retries are ours (tenacity), so botocore's are kept short."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 5, "read_timeout": 20},
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
