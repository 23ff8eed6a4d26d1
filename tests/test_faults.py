"""Frozen workers are dropped and fenced; user errors count against max_failures."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

import elastic_train as et
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import read_progress


def _trainer(run_dirs, steps, num_workers, fault, step_time=0.1, **kw):
    return make_trainer(run_dirs, num_workers, steps=steps, step_time=step_time, fault=fault, **kw)


@pytest.mark.timeout(180)
def test_sigstopped_worker_is_dropped_ended_and_replaced(local_ray, run_dirs):
    """A frozen worker is dropped after the heartbeat timeout and its process is ended: alive, it would
    keep its CPU (or GPU) and, on this full 2-CPU machine, no replacement could be placed. No warm
    spare: the survivor goes on alone until the replacement started after the loss is ready (a spare
    ready in time would take the lost worker's place at once: tests/test_warm_spares.py)."""
    elastic = et.ElasticConfig(heartbeat_timeout_s=3.0, warm_spares_per_node=0)
    trainer = _trainer(run_dirs, 150, (1, 2), {"kind": "stop", "rank": 1, "at_step": 10, "point": "before_report"},
                       elastic=elastic)
    join = fit_in_background(trainer)
    fault_file = Path(run_dirs["log_dir"]) / "fault.json"
    fault = wait_for(lambda: fault_file.exists() and json.loads(fault_file.read_text() or "null"), 60, "the freeze")

    def resumed_alone():
        return [p for p in read_progress(run_dirs["log_dir"]) if p["time"] > fault["time"] and p["world"] == 1]

    first_alone = wait_for(resumed_alone, 30, "the survivor to go on alone")[0]
    wait_for(lambda: not _running(fault["pid"]), 30, "the frozen process to be ended")
    result = join(150)
    assert result.error is None, result.error
    assert result.metrics["step"] == 150

    # Dropped within the heartbeat timeout (plus one control tick and the restart itself).
    lost = [e for e in result.events if e["kind"] == "worker_lost" and e["pid"] == fault["pid"]]
    assert lost and lost[0]["cause"] == "silent" and "heartbeat" in lost[0]["reason"]
    assert first_alone["time"] - fault["time"] < elastic.heartbeat_timeout_s + 1.5
    # Nothing of the frozen process landed in a later generation; a new process took its place.
    progress = read_progress(run_dirs["log_dir"])
    assert not [p for p in progress if p["pid"] == fault["pid"] and p["generation"] >= first_alone["generation"]]
    assert result.world_sizes[-1] == 2
    last = max(p["generation"] for p in progress)
    assert len({p["pid"] for p in progress if p["generation"] == last}) == 2
    assert fault["pid"] not in {p["pid"] for p in progress if p["generation"] == last}


@pytest.mark.timeout(180)
def test_hung_worker_in_a_loop_without_collective_is_replaced_in_a_fixed_size_run(local_ray, run_dirs):
    """A loop stuck for good (a deadlock, a hung read) while its heartbeat thread runs on: the progress
    watchdog finds the rank behind the others, ends its process and a replacement takes its place.
    The survivor, rank 0 still (the loop reads its rank where it uses it), goes on in place meanwhile;
    once the replacement is ready both re-enter from the newest report, in memory (no warm spare, which
    would be that replacement at the loss if it were ready by then)."""
    from tests.loops import sharded_directory_loop

    elastic = et.ElasticConfig(progress_timeout_s=3.0, warm_spares_per_node=0)
    result = make_trainer(run_dirs, 2, sharded_directory_loop, steps=160, step_time=0.05, elastic=elastic,
                          fault={"kind": "hang", "rank": 1, "at_step": 10}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 160
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    lost = [e for e in result.events if e["kind"] == "worker_lost"]
    assert [e["pid"] for e in lost] == [fault["pid"]] and "progress_timeout_s" in lost[0]["reason"]
    assert lost[0]["cause"] == "hung"
    assert not _running(fault["pid"])
    assert result.world_sizes == [2, 1, 2]
    went_on, back = [e for e in result.events if e["kind"] == "generation"][1:]
    assert went_on["resume_from"] == "in place" and went_on["resume_index"] == 10  # at the report rank 1 never made
    assert back["resume_from"] == "memory" and back["resume_index"] > 10


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_user_error_within_max_failures_is_retried(local_ray, run_dirs):
    result = _trainer(run_dirs, 20, 2, {"kind": "raise", "rank": 1, "at_step": 5}, step_time=0.0,
                      max_failures=1).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 20
    failures = [e for e in result.events if e["kind"] == "failure"]
    assert len(failures) == 1 and "injected user error at step 5" in failures[0]["detail"]


@pytest.mark.timeout(120)
def test_reports_every_rank_made_before_a_peer_raised_are_the_failed_runs_metrics(local_ray, run_dirs):
    """No checkpoint; reports go to the supervisor in batches, and a long `report_interval_s` holds
    rank 0's in its sender. Rank 1 raises at step 5 while rank 0 waits in step 5's all-reduce: the run
    fails, and its metrics are those of report 4, which every rank made. Rank 0 leaves the generation
    and sends its reports before the run's end is settled."""
    elastic = et.ElasticConfig(report_interval_s=5.0)
    with pytest.raises(et.WorkerGroupError, match="injected user error at step 5"):
        _trainer(run_dirs, 20, 2, {"kind": "raise", "rank": 1, "at_step": 5}, step_time=0.0, checkpoints=False,
                 elastic=elastic).fit()
    result = et.Result.from_path(str(Path(run_dirs["storage"], "run")))
    assert result.metrics["step"] == 4 and result.checkpoint is None


@pytest.mark.timeout(120)
def test_user_error_over_max_failures_surfaces_with_traceback(local_ray, run_dirs):
    with pytest.raises(et.WorkerGroupError) as caught:
        _trainer(run_dirs, 20, 2, {"kind": "raise", "rank": 1, "at_step": 5}, step_time=0.0).fit()
    text = str(caught.value)
    assert "ValueError: injected user error at step 5" in text
    assert "Traceback" in text and "fault_once" in text and "linear_regression_loop" in text
    assert list(caught.value.worker_failures) == [1]
    # Metrics reported before the failure are kept, and so is the last committed checkpoint.
    result = et.Result.from_path(str(Path(run_dirs["storage"], "run")))
    assert result.metrics["step"] == 4
    assert result.checkpoint is not None and result.checkpoint.to_dict()["step"] == 4


@pytest.mark.timeout(60)
def test_below_min_workers_fails_after_the_configured_wait(local_ray, run_dirs):
    trainer = _trainer(run_dirs, 5, (3, 4), None, elastic=et.ElasticConfig(min_workers_timeout_s=10.0))
    started = time.monotonic()
    with pytest.raises(et.ControllerError) as caught:
        trainer.fit()
    assert "only 2 of the minimum 3 workers could be placed" in str(caught.value)
    assert "min_workers_timeout_s" in str(caught.value)
    assert 10.0 <= time.monotonic() - started < 40
