"""Nodes lost and added on a simulated multi-node cluster (ray.cluster_utils.Cluster)."""

from __future__ import annotations

import time

import pytest

from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import read_progress


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
    print("remove_node -> step at world 2: %.3f s" % (shrunk[0]["time"] - removed_at))
