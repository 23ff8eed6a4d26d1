"""In-place recovery: survivors keep their process, the group is rebuilt at the new size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import make_trainer
from tests.loops import read_progress


@pytest.mark.timeout(180)
def test_sigkill_of_rank_1_recovers_in_place_and_grows_back(local_ray, run_dirs):
    steps = 60
    result = make_trainer(run_dirs, (1, 2), steps=steps, step_time=0.1,
                          fault={"kind": "kill", "rank": 1, "at_step": 10}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == steps

    progress = read_progress(run_dirs["log_dir"])
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    rank0 = [p for p in progress if p["rank"] == 0]
    # Every step was completed, rank 0 kept its process throughout.
    assert {p["step"] for p in rank0} == set(range(1, steps + 1))
    assert {p["pid"] for p in rank0} == {rank0[0]["pid"]}
    assert fault["pid"] != rank0[0]["pid"]
    # The next step completed within 2 s of the kill.
    after = [p["time"] for p in progress if p["time"] > fault["time"]]
    assert min(after) - fault["time"] < 2.0, min(after) - fault["time"]
    # At most one step redone with a checkpoint every step.
    redone = sum(n - 1 for n in Counter(p["step"] for p in rank0).values())
    assert redone <= 1
    # The world shrank to 1, then returned to 2 once the freed CPU took a new worker.
    assert result.world_sizes[0] == 2 and 1 in result.world_sizes and result.world_sizes[-1] == 2
    assert any(p["world"] == 2 and p["step"] > fault["step"] for p in progress)
    # The newcomer had paid PyTorch's first-use costs before it joined (the survivor would have waited);
    # the first generation's workers pay them in their loops, all at once.
    first = {p["pid"] for p in progress if p["generation"] == 0}
    newcomers = [p for p in progress if p["pid"] not in first]
    assert len(first) == 2 and len({p["pid"] for p in newcomers}) == 1 and all(p["warm"] for p in newcomers)
    # Losing a worker did not count as a failure of the user's code.
    assert not [e for e in result.events if e["kind"] == "failure"]
    print("kill -> next step: %.3f s" % (min(after) - fault["time"]), "world sizes:", result.world_sizes)


@pytest.mark.timeout(180)
def test_rank_0_alone_checkpoints_and_dies_its_replica_serves_the_survivor(local_ray, run_dirs):
    """Only rank 0 reports checkpoints (Ray Train's usual pattern); its parts are replicated to rank 1's
    memory, so losing rank 0 resumes from memory, not from storage, with at most one step redone."""
    steps = 30
    result = make_trainer(run_dirs, (1, 2), steps=steps, step_time=0.1, rank0_saves=True,
                          fault={"kind": "kill", "rank": 0, "at_step": 10}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == steps
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    after_kill = [e for e in result.events if e["kind"] == "generation" and e["time"] > fault["time"]]
    assert after_kill[0]["resume_from"] == "memory" and after_kill[0]["world_size"] == 1
    # The kill came as step 10 began: the replica of step 9 may still have been on its way, so 8 or 9.
    assert after_kill[0]["resume_index"] >= fault["step"] - 2
    steps_run = [p["step"] for p in read_progress(run_dirs["log_dir"]) if p["rank"] == 0]
    assert sorted(set(steps_run)) == list(range(1, steps + 1))
    assert sum(n - 1 for n in Counter(steps_run).values()) <= 1
