"""Chaos scenarios: one per fault kind and the combinations, injected by the `chaos` harness from
outside the run, each checking the invariants of `scenario.check_invariants` (not just that the
run did not crash). The recovery figures are written to <log_dir>/scenario.json."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

import elastic_train as et
from chaos import schedules
from chaos.harness import ChaosRunner
from chaos.storage_proxy import FaultyStorageProxy
from chaos.traces import read_trace
from tests.chaos.scenario import attach, chaos_trainer, check_invariants, longest_stalls, recovery_times
from tests.fake_metadata import FakeMetadataServer
from tests.helpers import fit_in_background
from tests.loops import read_progress

TRACE = Path(__file__).resolve().parent / "data" / "oobleck-aws-g4dn-events.csv"  # see data/README.md
FAST_DETECTION = et.ElasticConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0)


def _run(run_dirs: dict, trainer: et.TorchTrainer, world: int, firings: list, fault: str, target: str,
         redone_per_fault: int = 1, storage_options: dict | None = None, live_state: bool = False,
         **context) -> dict:
    join = fit_in_background(trainer)
    fault_args = context.pop("fault_args", {})
    ready = context.pop("ready", None)
    ctx = attach(run_dirs, world, **context)
    runner = ChaosRunner(ctx, firings, fault=fault, target=target, seed=1, ready=ready, **fault_args).start()
    result = join(240)
    runner.stop()
    faults = [e for e in ctx.log.entries if e["kind"] in ("sigkill", "kill-actor", "hang", "preempt-notice",
                                                          "lose-node", "storage", "kill-supervisor")]
    assert faults, "no fault was injected"
    figures = check_invariants(result, run_dirs, len(faults), redone_per_fault=redone_per_fault,
                               storage_options=storage_options, live_state=live_state)
    return _record(run_dirs, figures, faults)


def _record(run_dirs: dict, figures: dict, faults: list[dict]) -> dict:
    """Add the recovery figures of `faults` and write them to <log_dir>/scenario.json (see report.py)."""
    scenario = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    figures.update(scenario=scenario, faults=len(faults), recovery_s=recovery_times(run_dirs["log_dir"], faults),
                   stall_s=longest_stalls(run_dirs["log_dir"], faults))
    Path(run_dirs["log_dir"], "scenario.json").write_text(json.dumps(figures))
    return figures


@pytest.mark.timeout(300)
def test_sigkill_random_workers_every_few_seconds(local_ray, run_dirs):
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2)), 2, schedules.every(3.0, 2), "sigkill", "random")


@pytest.mark.timeout(300)
def test_sigkill_with_live_state_between_stored_checkpoints(local_ray, run_dirs):
    """Every 5th checkpoint is stored; those between are the live tensors, never serialized unless a
    recovery needs them. Rank 1 is killed (a second time once the group grew back): rank 0 holds the
    state, so the run ends with a fault-free run's state and at most one step redone per kill. (Were
    the only holder lost, the run would go back to the last stored checkpoint: the cadence's price.)"""
    trainer = chaos_trainer(run_dirs, (1, 2), checkpoint_config=et.CheckpointConfig(store_every_n_reports=5))
    _run(run_dirs, trainer, 2, schedules.every(3.0, 2), "sigkill", "rank:1")


@pytest.mark.timeout(300)
def test_sigkill_with_no_checkpoint_in_the_loop(local_ray, run_dirs):
    """The loop reports no checkpoint: its model and optimizer (SGD with momentum) are kept live
    (`prepare_model(model, live_state=True)`). Random workers are SIGKILLed: the survivor goes on from
    its own state, the replacement gets it from the survivor, and no step is redone; the run ends with a
    fault-free run's state, and stored nothing. A fault fires only while two ranks hold the state (both
    reported in a generation past the previous fault's): the death of its only holder starts the run
    over, as the README's known limits say."""
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2), live_state=True), 2, schedules.every(3.0, 2), "sigkill", "random",
         redone_per_fault=0, live_state=True, ready=lambda fired_at: _held_twice(run_dirs["log_dir"], fired_at))


def _held_twice(log_dir: str, since: float) -> bool:
    """Have both ranks of a world of 2 reported (logged a step after their first) in a generation newer
    than the one running at wall time `since`?"""
    progress = [p for p in read_progress(log_dir) if "step" in p]
    before = max((p["generation"] for p in progress if p["time"] <= since), default=-1)
    steps = Counter((p["generation"], p["rank"]) for p in progress
                    if p["time"] > since and p["generation"] > before and p["world"] == 2)
    return any(steps[g, 0] >= 2 and steps[g, 1] >= 2 for g, _ in steps)


@pytest.mark.timeout(300)
def test_ray_kill_of_rank_0(local_ray, run_dirs):
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2)), 2, schedules.at([2.0]), "kill-actor", "rank0")


@pytest.mark.timeout(300)
def test_hang_is_dropped_and_its_process_replaced(local_ray, run_dirs):
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2), elastic=FAST_DETECTION), 2, schedules.at([2.0]), "hang",
         "rank:1", fault_args={"hang_s": 4.0})


@pytest.mark.timeout(300)
def test_two_workers_at_once(local_ray, run_dirs):
    trainer = chaos_trainer(run_dirs, (1, 3))
    trainer.scaling_config = et.ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 0.5})
    _run(run_dirs, trainer, 3, schedules.at([2.0]), "sigkill", "all-but-one")


@pytest.mark.timeout(300)
def test_poisson_kills(local_ray, run_dirs):
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2)), 2, schedules.poisson(3.0, 3, seed=4), "sigkill", "random")


@pytest.mark.timeout(300)
def test_supervisor_killed_twice_mid_run(local_ray, run_dirs):
    """Ray restarts the supervisor; it adopts the workers, whose generation goes on: no step redone."""
    figures = _run(run_dirs, chaos_trainer(run_dirs, (1, 2)), 2, schedules.every(3.0, 2), "kill-supervisor",
                   "rank0", redone_per_fault=0)
    assert figures["world_sizes"] == [2]


@pytest.mark.timeout(300)
def test_preemption_with_sigterm_notice_loses_no_step(local_ray, run_dirs):
    _run(run_dirs, chaos_trainer(run_dirs, (1, 2)), 2, schedules.at([2.0]), "preempt", "rank:1",
         redone_per_fault=0, fault_args={"notice_s": 5.0})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_preemption_notice_from_cloud_metadata_loses_no_step(local_ray, run_dirs, cloud):
    metadata = FakeMetadataServer()
    elastic = et.ElasticConfig(preemption_pollers=(cloud,), preemption_metadata_url=metadata.url,
                               preemption_poll_interval_s=0.2)
    join = fit_in_background(chaos_trainer(run_dirs, (1, 2), elastic=elastic))
    ctx = attach(run_dirs, 2)
    rank1 = next(m for m in ctx.run.members() if m.rank == 1)
    notice = {"time": time.time(), "kind": "preempt-notice"}
    metadata.post_notice(5.0, pids={rank1.pid})
    result = join(240)
    metadata.close()
    _record(run_dirs, check_invariants(result, run_dirs, 1, redone_per_fault=0), [notice])
    notices = [e for e in result.events if e["kind"] == "preemption_notice"]
    assert [(e["pid"], e["source"]) for e in notices] == [(rank1.pid, cloud)]


@pytest.mark.timeout(300)
def test_storage_outage_delays_persistence_only(local_ray, run_dirs, s3_bucket):
    with FaultyStorageProxy(s3_bucket["endpoint"], seed=3) as proxy:
        options = {**s3_bucket["options"], "endpoint_url": proxy.url}
        trainer = chaos_trainer(run_dirs, 2, storage_path=s3_bucket["url"], storage_options=options)
        _run(run_dirs, trainer, 2, schedules.at([1.5]), "storage", "random", redone_per_fault=0,
             storage_options=s3_bucket["options"], proxy=proxy, fault_args={"outage_s": 4.0})
        assert proxy.stats["faults"].get("error", 0) > 0


@pytest.mark.timeout(300)
def test_node_holding_rank_0_lost_then_a_node_added(three_node_cluster, run_dirs):
    cl, _ = three_node_cluster
    # The run ends at world 3 only: under load its steps could all be done before the added node's
    # worker joins, so it waits for the growth at its end instead of racing it.
    join = fit_in_background(chaos_trainer(run_dirs, (2, 3), end_at_world=3))
    ctx = attach(run_dirs, 3, cluster=cl)
    ChaosRunner(ctx, schedules.at([0.5]), fault="lose-node", target="node-of-rank0").run()
    ChaosRunner(ctx, schedules.at([2.0]), fault="add-node").run()
    result = join(240)
    _record(run_dirs, check_invariants(result, run_dirs, 1),
            [e for e in ctx.log.entries if e["kind"] == "lose-node"])
    assert 2 in result.world_sizes and result.world_sizes[-1] == 3


@pytest.mark.timeout(300)
def test_replay_of_a_real_spot_trace(three_node_cluster, run_dirs):
    cl, nodes = three_node_cluster
    # The g4dn trace's first hours, 1 trace hour = 10 s, at most 3 nodes (the 3 we start with).
    events = [e for e in read_trace(TRACE, compress=360, max_nodes=3) if e.at_s <= 12.0]
    join = fit_in_background(chaos_trainer(run_dirs, (1, 3)))
    ctx = attach(run_dirs, 3, cluster=cl)
    runner = ChaosRunner(ctx, schedules.replay([e for e in events[3:]]), seed=1)
    runner.adopt_nodes([e.node for e in events[:3]], [n.node_id for n in nodes])
    runner.start()
    result = join(240)
    runner.stop()
    lost = [e for e in ctx.log.entries if e["kind"] == "lose-node"]
    assert lost, "the replayed trace removed no node"
    _record(run_dirs, check_invariants(result, run_dirs, len(lost)), lost)
