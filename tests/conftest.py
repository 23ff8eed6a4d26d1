"""Shared fixtures: a real local Ray instance, and a clean storage folder per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

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
def run_dirs(tmp_path):
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    return {"log_dir": str(log_dir), "storage": str(tmp_path / "storage")}


def pytest_configure(config):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
