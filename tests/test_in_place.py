"""Loops written as Ray Train's guides write them go on in place when a peer is lost mid-step: the
survivors complete the step among themselves, no step is redone, every sample of each epoch is used
once, and the run ends where a fault-free run through the same world sizes ends (tests/guide_loops.py)."""

from __future__ import annotations

import pytest
import torch

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.events import GenerationOpened
from elastic_train.run_folder.events import read_events
from tests.guide_loops import SAMPLES, completed_steps, final_state, guide_loop, replay
from tests.helpers import make_trainer
from tests.loops import read_progress

EPOCHS = 4


def check_lineage(log_dir: str, epochs: int) -> None:
    """Every sample of each epoch used once; no process computed a step twice."""
    steps = completed_steps(log_dir)
    for epoch in range(epochs):
        used = [i for (e, _), records in steps.items() if e == epoch for r in records for i in r["batch"]]
        assert sorted(used) == list(range(SAMPLES)), f"epoch {epoch}: a sample was skipped or used twice"
    by_process: dict[int, list[tuple[int, int]]] = {}
    for p in read_progress(log_dir):
        if "batch" in p:
            by_process.setdefault(p["pid"], []).append((p["epoch"], p["step"]))
    for pid, done in by_process.items():
        assert done == sorted(set(done)), f"process {pid} redid a step: {done}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("killed", [0, 1])
def test_guide_loop_goes_on_in_place_when_a_worker_is_killed_mid_epoch(local_ray, run_dirs, killed):
    result = make_trainer(run_dirs, (1, 2), guide_loop, epochs=EPOCHS, step_time=0.1,
                          fault={"kind": "kill", "rank": killed, "at_step": 103}).fit()
    assert result.error is None, result.error
    assert result.metrics["epoch"] == EPOCHS - 1
    check_lineage(run_dirs["log_dir"], EPOCHS)
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    assert [g.resume_from for g in opened][:2] == [None, "in place"], opened
    expected = replay(run_dirs["log_dir"])
    for name, value in final_state(result).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12)
