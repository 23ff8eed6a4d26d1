"""Model + optimizer state saved with `save_state` (torch.distributed.checkpoint) at one world size
loads at another, and training goes on exactly as if the world had never changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import elastic_train as et
from elastic_train.checkpoint import list_checkpoints
from elastic_train.torch.state import load_state
from tests.loops import dcp_loop

STEPS = 6


def _fit(run_dirs: dict, name: str, workers: int, steps: int) -> et.Result:
    result = et.TorchTrainer(
        dcp_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "steps": steps},
        scaling_config=et.ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name=name),
    ).fit()
    assert result.error is None, result.error
    return result


def _params(result: et.Result) -> dict[str, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with result.checkpoint.as_directory() as d:
        load_state(d, model, optimizer)
    return model.state_dict()


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """dcp_loop's parameters after `steps` fault-free steps, in this process: its ranks' equal shares of
    each global batch, their gradients averaged, are the whole batch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        x = torch.randn(24, 6, generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def _fork(run_dirs: dict, source: str, target: str) -> None:
    shutil.copytree(Path(run_dirs["storage"], source), Path(run_dirs["storage"], target))


@pytest.mark.timeout(300)
def test_state_saved_at_one_world_size_loads_at_another(local_ray, run_dirs):
    reference = _reference(2 * STEPS)
    at_4 = _fit(run_dirs, "at_4", 4, STEPS)
    saved = _params(at_4)
    files = list_checkpoints(at_4.path)[-1].manifest.files
    distcp = sorted(n for n in files if n.endswith(".distcp"))
    assert distcp == [f"__{r}_0.distcp" for r in range(4)] and ".metadata" in files
    # Replicated DDP tensors are written once, spread over the ranks: no rank writes it all.
    sizes = [files[n]["size"] for n in distcp]
    assert max(sizes) < 0.75 * sum(sizes), sizes

    for name, workers in (("4_to_2", 2), ("4_to_3", 3)):
        _fork(run_dirs, "at_4", name)
        resumed = _fit(run_dirs, name, workers, 2 * STEPS)
        loaded = torch.load(Path(run_dirs["log_dir"], f"loaded_world{workers}_step{STEPS}.pt"))
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"{name}: {key} changed on load"
        assert [h["step"] for h in resumed.metrics_history] == list(range(STEPS + 1, 2 * STEPS + 1))
        for key, value in _params(resumed).items():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)

    at_2 = _fit(run_dirs, "at_2", 2, STEPS)
    _fork(run_dirs, "at_2", "2_to_4")
    for key, value in _params(_fit(run_dirs, "2_to_4", 4, 2 * STEPS)).items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
    assert _params(at_2).keys() == saved.keys()


@pytest.mark.timeout(30)
def test_load_state_refuses_code_in_checkpoint_metadata(tmp_path):
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    model = torch.nn.Linear(2, 1)
    with pytest.raises(et.CheckpointError, match="refusing to load"):
        load_state(tmp_path, model)
    assert not (tmp_path / "pwned").exists()
