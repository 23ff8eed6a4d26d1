"""The matrix: checkpoint pattern x fault x scaling x collective, on real Ray (see tests/patterns.py).

patterns: rank 0 alone writes a folder (Ray Train's usual pattern), every rank writes the same file
name, every rank writes its own shard, `elastic_train.torch.save_state` (DCP), no checkpoint at all,
and no checkpoint with the model and optimizer kept live (`prepare_model(model, live_state=True)`).
faults (once, at the start of step 6): SIGKILL of the rank that checkpoints (rank 0), SIGKILL of
another (rank 1), SIGTERM (a preemption notice) to rank 0 or 1, SIGSTOP of a rank (SIGCONTed 4 s
later, or never), a RuntimeError raised by every rank of the group.
scaling: fixed 2, or (1, 2). collective in the step: DDP, dist.all_reduce, none.

The 25 main cells cover every pair of values of the four dimensions (a 5x5 Latin square over pattern
and fault; scaling = (i + j) % 2, collective = (i + 2j) % 3). Each must finish (or fail exactly as
its FailureConfig says) with the state after every computed step, the final metrics and the final
committed checkpoint equal to the fault-free trajectory, computed exactly in this process, and at
most one step redone (none with a notice or a kept state; without checkpoints, from scratch). Cells
of the kept state follow the square's, for the faults a lost peer or a bug brings, and so do those of
FSDP2 sharded by the loop (Ray's FSDP2 guide: every rank saves its shards with DCP, `dcp.save` or
`dcp.async_save`), for a lost rank 0 at a fixed size and where the world changes.
"""

from __future__ import annotations

import pytest

import elastic_train as train
from tests.loops import read_progress
from tests.patterns import (
    Cell,
    checkpoint_state,
    read_fault,
    run_cell,
    step_lines,
    steps_redone,
    summary,
    trajectory,
    wrong_states,
)

P = ["rank0", "same_name", "shard", "dcp", "none"]
F = ["kill_ckpt", "kill_other", "term", "stop", "raise"]
TERM_RANK = {"rank0": 0, "same_name": 1, "shard": 1, "dcp": 0, "none": 0}
STOP = {  # pattern -> (rank, seconds until SIGCONT or None)
    "rank0": (0, None), "same_name": (1, 4.0), "shard": (1, 4.0), "dcp": (0, 4.0), "none": (1, None),
}


def _latin_square() -> list[Cell]:
    cells = []
    for i, pattern in enumerate(P):
        for j, fault in enumerate(F):
            cell = Cell(pattern, fault, scaling=2 if (i + j) % 2 == 0 else (1, 2),
                        collective=["ddp", "allreduce", "none"][(i + 2 * j) % 3])
            if fault == "term":
                cell.rank = TERM_RANK[pattern]
            elif fault == "stop":
                cell.rank, cell.resume_after_s = STOP[pattern]
                cell.steps = 30  # a loop without a collective goes on until the heartbeat timeout
            elif fault == "raise":
                cell.max_failures = 1
            cells.append(cell)
    return cells


CELLS = _latin_square() + [
    # One bug hit by every rank, with no failure allowed: the run fails, with the bug's traceback.
    Cell("same_name", "raise", 2, "allreduce", max_failures=0, expect_error=True),
    # A worker frozen for good in a fixed-size run that fills the cluster: it holds the only free slot.
    Cell("shard", "stop", 2, "ddp", rank=1, resume_after_s=None, steps=30),
    # No checkpoint, the state kept live: no step is redone, whatever the fault.
    Cell("kept", "kill_ckpt", 2, "ddp"),
    Cell("kept", "stop", (1, 2), "allreduce", rank=1, resume_after_s=4.0, steps=30),
    Cell("kept", "raise", (1, 2), "ddp", max_failures=1),
    # FSDP2 sharded by the loop, DCP saved by every rank (rank 0's part alone holds .metadata): rank 0
    # lost, the survivor renumbered 1 -> 0 and .metadata served from its replica; with dcp.async_save,
    # the world shrinking to 1 and growing back.
    Cell("fsdp", "kill_ckpt", 2, "fsdp"),
    Cell("fsdp_async", "kill_ckpt", (1, 2), "fsdp"),
]
FAULT_FREE = [Cell("rank0", "none", 2, "ddp"), Cell("shard", "none", 2, "none"),
              Cell("dcp", "none", (1, 2), "allreduce")]


def _check(cell: Cell, run_dirs: dict, result: train.Result) -> None:
    timeline = summary(result)
    progress = read_progress(run_dirs["log_dir"])
    fault = read_fault(run_dirs["log_dir"])
    if cell.fault != "none":
        assert fault is not None, "the fault was never injected"
    failures = [e for e in result.events if e["kind"] == "failure"]

    if cell.expect_error:
        assert isinstance(result.error, train.TrainingFailedError), f"the run did not fail\n{timeline}"
        assert f"injected bug at step {cell.at_step}" in str(result.error), str(result.error)[-2000:]
        assert len(failures) == cell.max_failures + 1, timeline
        assert result.metrics["step"] == cell.at_step - 1, result.metrics
        return

    assert result.error is None, f"{str(result.error)[-3000:]}\n--- timeline:\n{timeline}"
    expected = trajectory(cell.steps)
    final_w, final_buf = expected[cell.steps]
    assert result.metrics["step"] == cell.steps and result.metrics["w"] == final_w, (result.metrics, final_w)

    lines = step_lines(progress, result)
    assert {p["step"] for p in lines} == set(range(1, cell.steps + 1)), timeline
    wrong = wrong_states(lines, cell.steps)
    assert not wrong, "state differs from the fault-free run's:\n" + "\n".join(wrong[:10]) + f"\n{timeline}"

    if cell.pattern in ("none", "kept"):
        assert result.checkpoint is None
    else:
        assert result.checkpoint is not None, "no committed checkpoint"
        assert checkpoint_state(result.checkpoint, cell.pattern) == (cell.steps, final_w, final_buf), \
            f"the final committed checkpoint is not the last step's\n{timeline}"

    # Events: what the fault was taken for.
    if cell.fault == "raise":
        assert len(failures) == 1, f"one bug hit by the whole group counts once:\n{timeline}"
    else:
        assert not failures, f"no failure of the user's code here:\n{timeline}"
    if cell.fault in ("kill_ckpt", "kill_other", "stop"):
        assert [e for e in result.events if e["kind"] == "worker_lost" and e["pid"] == fault["pid"]], timeline
    if cell.fault == "term":
        assert [e for e in result.events if e["kind"] == "preemption_notice" and e["pid"] == fault["pid"]], timeline
    if cell.scaling == 2:
        assert set(result.world_sizes) == {2}, f"a fixed-size run ran at {result.world_sizes}\n{timeline}"

    # Steps redone.
    redone = steps_redone(lines)
    if cell.pattern == "none":
        return  # no checkpoint: it starts over (the state checks above still hold)
    if cell.fault == "term" or cell.pattern == "kept":
        bound = 0
    else:
        bound = 1  # even with no collective in the loop: `report()` is a barrier
    assert redone <= bound, f"{redone} steps redone (at most {bound})\n{timeline}"
    if fault is not None and cell.fault != "raise":
        after = [e for e in result.events if e["kind"] == "generation" and e["generation"] > fault["generation"]]
        assert after, timeline
        # The faulted rank had reported step at_step - 1; its replica (rank0 pattern) may lag one.
        assert after[0]["resume_index"] is not None and after[0]["resume_index"] >= cell.at_step - 2, timeline


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(local_ray, run_dirs, cell):
    if cell.expect_error:
        with pytest.raises(train.WorkerGroupError):
            run_cell(run_dirs, cell)
        result = train.Result.from_path(f"{run_dirs['storage']}/run")  # what the failed run left
    else:
        result = run_cell(run_dirs, cell)
    _check(cell, run_dirs, result)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cell", FAULT_FREE, ids=[c.id for c in FAULT_FREE])
def test_fault_free(local_ray, run_dirs, cell):
    """The loop and the trajectory agree when nothing goes wrong (the matrix's own check)."""
    result = run_cell(run_dirs, cell)
    _check(cell, run_dirs, result)
    assert steps_redone(step_lines(read_progress(run_dirs["log_dir"]), result)) == 0
    assert len(result.world_sizes) == 1
