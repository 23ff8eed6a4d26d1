"""The fixtures Ray Train's test files use, the same in both runs (Ray's and ours): the conftest of the
folder the ported files run in. Ray's own conftests import helpers that its wheel does not ship, so
the ones the conformance files need are written here, as Ray's define them."""

from __future__ import annotations

import copy
import logging
import os

import boto3
import pytest
import ray
from ray._common.test_utils import simulate_s3_bucket
from ray.cluster_utils import Cluster

S3_PORT = 5002  # the port Ray's fixture serves its S3 bucket on
S3_REGION = "us-west-2"


@pytest.fixture
def ray_start_4_cpus():
    info = ray.init(num_cpus=4)
    yield info
    ray.shutdown()


@pytest.fixture
def ray_2_node_2_gpu():
    cluster = Cluster()
    for _ in range(2):
        cluster.add_node(num_cpus=4, num_gpus=2)
    ray.init(address=cluster.address)
    yield
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def restore_data_context():
    """Ray Data's: any change a test makes to the DataContext is undone after it."""
    from ray.data import DataContext

    original = copy.deepcopy(DataContext.get_current())
    yield DataContext.get_current()
    DataContext._set_current(original)


@pytest.fixture
def shutdown_only():
    yield None
    ray.shutdown()


@pytest.fixture
def mock_s3_bucket_uri():
    """A bucket on a moto server, as a URI in pyarrow's form: s3://<bucket>?region=...&endpoint_override=..."""
    with simulate_s3_bucket(port=S3_PORT, region=S3_REGION) as uri:
        bucket = uri.split("://", 1)[1].split("?", 1)[0]
        boto3.client("s3", region_name=S3_REGION, endpoint_url=f"http://localhost:{S3_PORT}").create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": S3_REGION})
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        yield uri


def pytest_configure(config):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
