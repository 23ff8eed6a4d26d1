"""Nodes lost and added on a simulated multi-node cluster (ray.cluster_utils.Cluster)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import ray
from ray.cluster_utils import Cluster

import elastic_train as et
from tests.conftest import ray_runtime_env, stop_ray
from tests.fake_metadata import FakeMetadataServer
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import linear_regression_loop, read_progress


@pytest.mark.timeout(240)
def test_node_removed_then_added(three_node_cluster, run_dirs):
    cluster, nodes = three_node_cluster
    steps = 150
    join = fit_in_background(make_trainer(run_dirs, (2, 3), steps=steps, step_time=0.1))

    def at_world(size, after=0.0):
        return [p for p in read_progress(run_dirs["log_dir"]) if p["world"] == size and p["time"] > after]

    first = wait_for(lambda: at_world(3), 90, "3 workers training")
    rank2 = [p for p in first if p["rank"] == 2][0]
    survivors_pids = {p["pid"] for p in first if p["rank"] in (0, 1)}
    victim = next(n for n in nodes if n.node_id == rank2["node"])
    removed_at = time.time()
    cluster.remove_node(victim)
    shrunk = wait_for(lambda: at_world(2, removed_at), 30, "the run to shrink to 2")
    assert shrunk[0]["time"] - removed_at < 5.0, shrunk[0]["time"] - removed_at

    added_at = time.time()
    cluster.add_node(num_cpus=1)
    wait_for(lambda: at_world(3, added_at), 90, "the run to grow back to 3")
    result = join(180)
    assert result.error is None, result.error
    assert result.metrics["step"] == steps
    progress = read_progress(run_dirs["log_dir"])
    assert {p["step"] for p in progress if p["rank"] == 0} == set(range(1, steps + 1))
    # Both survivors kept their processes through the shrink and the growth.
    assert survivors_pids <= {p["pid"] for p in progress if p["world"] == 3 and p["time"] > added_at}
    assert result.world_sizes[:1] == [3] and 2 in result.world_sizes and result.world_sizes[-1] == 3
    # The loop reports a checkpoint every step: the new node's worker joins at the next report once ready
    # (a warm spare beside a survivor may become ready after the node was added too: it does not join).
    grown = next(e for e in result.events if e["kind"] == "generation" and e["time"] > added_at)
    (newcomer,) = set(grown["members"]) - {w for e in result.events if e["kind"] == "generation" and e["time"] < added_at
                                           for w in e["members"]}
    ready = next(e for e in result.events if e["kind"] == "worker_ready" and str(e["worker_id"]) == str(newcomer))
    assert grown["world_size"] == 3 and grown["time"] - ready["time"] <= 0.5, (ready, grown)
    print("remove_node -> step at world 2: %.3f s; worker ready -> grown: %.3f s"
          % (shrunk[0]["time"] - removed_at, grown["time"] - ready["time"]))


@pytest.mark.timeout(240)
def test_machine_notice_places_the_replacement_on_another_machine_with_no_step_lost(run_dirs):
    """A cloud's preemption notice is for the machine: the replacement, requested at once, goes to
    another machine even where the leaving one has room, and the fixed-size run goes on at 2 from
    the state handed over, with no step redone."""
    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    leaving = cluster.add_node(num_cpus=6)  # room for both workers and their replacement
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env())
    metadata = FakeMetadataServer()
    try:
        elastic = et.ElasticConfig(preemption_pollers=("aws",), preemption_metadata_url=metadata.url,
                                   preemption_poll_interval_s=0.2)
        steps = 60
        join = fit_in_background(make_trainer(run_dirs, 2, steps=steps, step_time=0.1, rank0_saves=True,
                                              elastic=elastic))
        first = wait_for(lambda: [p for p in read_progress(run_dirs["log_dir"]) if p["step"] >= 5], 90,
                         "2 workers training")
        assert {p["node"] for p in first} == {leaving.node_id}
        other = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        rank0_pid = next(p["pid"] for p in first if p["rank"] == 0)
        metadata.post_notice(20.0, pids={rank0_pid})
        result = join(180)
    finally:
        metadata.close()
        ray.shutdown()
        cluster.shutdown()
    assert result.error is None, result.error
    assert result.metrics["step"] == steps and result.world_sizes == [2, 2]
    progress = read_progress(run_dirs["log_dir"])
    last = max(p["generation"] for p in progress)
    nodes = {p["pid"]: p["node"] for p in progress if p["generation"] == last}
    assert rank0_pid not in nodes and other.node_id in nodes.values()
    rank0_steps = [p["step"] for p in progress if p["rank"] == 0]
    assert sorted(rank0_steps) == list(range(1, steps + 1)), "a step was lost or redone"


def _placed_run(run_dirs: dict, name: str, steps: int, **scaling) -> et.TorchTrainer:
    return et.TorchTrainer(
        linear_regression_loop, train_loop_config={"log_dir": run_dirs["log_dir"], "steps": steps, "step_time": 0.1},
        scaling_config=et.ScalingConfig(num_workers=2, **scaling),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name=name))


@pytest.mark.timeout(300)
def test_workers_go_where_placement_strategy_and_label_selector_say(run_dirs):
    """As Ray Train places its bundles: PACK fills one of the selected nodes, and a list of selectors
    gives each worker slot its own, which the replacement of a worker SIGKILLed keeps (PACK alone
    would put it beside the survivor)."""
    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    pool_a = {cluster.add_node(num_cpus=2, labels={"pool": "a"}).node_id for _ in range(2)}
    pool_b = cluster.add_node(num_cpus=2, labels={"pool": "b"}).node_id
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env())
    try:
        packed = _placed_run(run_dirs, "packed", 5, label_selector={"pool": "a"}).fit()
        assert packed.error is None, packed.error
        nodes = {p["node"] for p in read_progress(run_dirs["log_dir"])}
        assert len(nodes) == 1 and nodes <= pool_a, nodes

        shutil.rmtree(run_dirs["log_dir"])
        os.mkdir(run_dirs["log_dir"])
        steps = 80
        join = fit_in_background(_placed_run(run_dirs, "slots", steps, label_selector=[{"pool": "a"}, {"pool": "b"}]))
        first = wait_for(lambda: [p for p in read_progress(run_dirs["log_dir"]) if p["step"] >= 5], 90,
                         "2 workers training")
        assert {p["node"] in pool_a for p in first} == {True, False} and pool_b in {p["node"] for p in first}
        victim = next(p["pid"] for p in first if p["node"] == pool_b)
        os.kill(victim, signal.SIGKILL)
        result = join(180)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert result.error is None, result.error
    assert result.metrics["step"] == steps and result.world_sizes[-1] == 2
    progress = read_progress(run_dirs["log_dir"])
    last = [p for p in progress if p["generation"] == max(q["generation"] for q in progress)]
    assert victim not in {p["pid"] for p in last} and pool_b in {p["node"] for p in last}, last[-2:]
