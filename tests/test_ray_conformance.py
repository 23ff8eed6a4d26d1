"""Ray Train's own programs, ported by the import rule alone (tests/ray_conformance): the rule itself,
and Ray's examples that its wheel ships and that run without a download, run as a user runs them.
Ray's test files are not in its wheel: `python -m tests.ray_conformance --ray-source DIR` runs them
from a Ray checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from tests.ray_conformance.port import port, shared_modules_in

RAY_EXAMPLES = Path(ray.__file__).parent / "train" / "examples" / "pytorch"


@pytest.mark.timeout(10)
def test_the_import_rule_renames_the_public_api_and_nothing_else():
    source = "\n".join([
        "import ray",
        "import ray.train",
        "from ray import train",
        "from ray.train import Checkpoint, ScalingConfig",
        "from ray.train.torch import TorchTrainer",
        "from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer",
        "from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR",
        "from ray.train._checkpoint import Checkpoint as RayCheckpoint",
        "from ray.train.torch.config import _is_backend_nccl",
        "from ray.train.tests.util import create_dict_checkpoint",
        "from ray.train.examples.pytorch.torch_linear_example import train_func",
        "ray.init(num_cpus=4); ray.train.report({}); ray.train.collective.barrier()",
        "ray.tune.Tuner",
        "from ray.data.tests.conftest import restore_data_context",
    ])
    assert port(source, to_elastic_train=True).splitlines() == [
        "import ray",
        "import elastic_train",
        "import elastic_train as train",
        "from elastic_train import Checkpoint, ScalingConfig",
        "from elastic_train.torch import TorchTrainer",
        "from elastic_train.v2.api.data_parallel_trainer import DataParallelTrainer",
        "from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR",  # Ray's internals stay
        "from ray.train._checkpoint import Checkpoint as RayCheckpoint",
        "from ray.train.torch.config import _is_backend_nccl",  # a private name: Ray's too
        "from _ray_shared.train_tests_util import create_dict_checkpoint",  # shared by both runs
        "from _ray_shared.train_examples_pytorch_torch_linear_example import train_func",
        "ray.init(num_cpus=4); elastic_train.report({}); elastic_train.collective.barrier()",
        "ray.tune.Tuner",
        "from conftest import restore_data_context",  # Ray Data's fixture, as fixtures.py defines it
    ]
    assert port(source, to_elastic_train=False).splitlines()[1:4] == [
        "import ray.train", "from ray import train", "from ray.train import Checkpoint, ScalingConfig"]
    assert shared_modules_in(source) == {"ray.train.tests.util", "ray.train.examples.pytorch.torch_linear_example"}
    # `ray.train.report` reached through `import ray` alone: the module it now names is imported too.
    assert port("import ray\nfrom ray.train import ScalingConfig\nray.train.report({})", True).splitlines() == [
        "import ray", "import elastic_train", "from elastic_train import ScalingConfig", "elastic_train.report({})"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example, args", [("torch_linear_example.py", ["--smoke-test"])])
def test_rays_example_runs_on_elastic_train_ported_by_the_import_rule(no_ray, tmp_path, example, args):
    """As Ray's docs run it (it starts its own Ray instance): exits 0 with the run's final metrics."""
    script = tmp_path / example
    script.write_text(port((RAY_EXAMPLES / example).read_text(), to_elastic_train=True))
    done = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=200, env={**os.environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "'loss':" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(10)
def test_each_of_rays_test_files_is_run_or_left_out_with_its_reason():
    """Ray Train's test files, V2's and its integration tests': run side by side (FILES), or named in left_out.py
    with why, never both."""
    from tests.ray_conformance.__main__ import FILES
    from tests.ray_conformance.left_out import LEFT_OUT_FILES

    assert not set(FILES) & set(LEFT_OUT_FILES)
    assert all(reason.strip() for reason in LEFT_OUT_FILES.values())
    files = [*FILES, *LEFT_OUT_FILES]
    assert sum(f.startswith("v2/tests/") for f in files) >= 92  # every test_*.py of python/ray/train/v2/tests
    assert sum(f.startswith("tests/") for f in files) >= 49  # and of python/ray/train/tests
