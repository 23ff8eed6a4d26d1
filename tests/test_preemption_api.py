"""`get_preemption_info()` as Ray Train's guide uses it: every step the loop asks; when a node is
about to go, rank 0 (which alone checkpoints) reports a checkpoint at once. Every rank must see the
same answer at the same step, and the group re-forms right after that report, so no step is redone.

The notice comes as SIGTERM to rank 0's process, and, separately, as Ray draining the node that
holds rank 0 (through Ray's own drain API, as `ray drain-node`, KubeRay and the autoscaler do).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

import elastic_train as train
from elastic_train import Checkpoint, ElasticConfig, FailureConfig, PreemptionError, RunConfig, ScalingConfig
from elastic_train.supervisor.preemption.notices import Leaving, preemption_info
from elastic_train.torch import TorchTrainer, prepare_model
from tests.conftest import ray_runtime_env, release_ray, start_ray, stop_ray
from tests.helpers import fit_in_background, wait_for
from tests.loops import log_progress, read_progress
from tests.test_user_programs import flat, my_share, once, reference

STEPS = 24
SAVE_EVERY = 8


def preemption_aware_loop(config):
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = train.get_context()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
    saved_on_preemption = False
    for step in range(start + 1, config["steps"] + 1):
        if config.get("sigterm_step") == step and ctx.get_world_rank() == 0 and once(config):
            os.kill(os.getpid(), signal.SIGTERM)  # what a node shutting down sends its processes
        x, y = my_share(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_time"])
        preemption = train.get_preemption_info()
        log_progress(config["log_dir"], rank=ctx.get_world_rank(), generation=ctx.get_generation(), step=step,
                     pid=os.getpid(), node=ray.get_runtime_context().get_node_id(), params=flat(model),
                     preempted=preemption.preempted_ranks if preemption else None)
        metrics = {"loss": loss.item(), "step": step}
        save = step % SAVE_EVERY == 0 or (preemption is not None and not saved_on_preemption)
        if ctx.get_world_rank() == 0 and save:
            saved_on_preemption = saved_on_preemption or preemption is not None
            with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           os.path.join(temp_checkpoint_dir, "checkpoint.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(temp_checkpoint_dir))
        else:
            train.report(metrics)


def _trainer(run_dirs, failure_config: FailureConfig | None = None, **config) -> TorchTrainer:
    return TorchTrainer(
        preemption_aware_loop,
        train_loop_config={"steps": STEPS, "step_time": 0.1, "log_dir": run_dirs["log_dir"], **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"], failure_config=failure_config,
                             elastic_config=ElasticConfig(preemption_poll_interval_s=0.2)),
    )


def _assert_seen_alike_and_nothing_redone(result, run_dirs) -> None:
    progress = read_progress(run_dirs["log_dir"])
    # Every rank saw the notice at the same step, as the same ranks, in the generation it came in.
    seen = {(p["generation"], p["step"], tuple(p["preempted"])) for p in progress if p["preempted"]}
    first = min(seen)
    assert {p["rank"] for p in progress if p["preempted"] and p["step"] == first[1]} == {0, 1}, seen
    assert {s for s in seen if s[0] == first[0]} == {first} and first[2] == (0,), seen
    assert not [p for p in progress if p["generation"] > first[0] and p["preempted"]], "the notice outlived the leaver"
    # No step redone or lost, and the state is the fault-free run's.
    assert [h["step"] for h in result.metrics_history] == list(range(1, STEPS + 1))
    expected = reference(STEPS)
    for p in progress:
        assert torch.allclose(torch.tensor(p["params"]), torch.tensor(expected[p["step"]][0]), rtol=1e-5, atol=1e-6)
    assert result.metrics["loss"] == pytest.approx(expected[STEPS][1], rel=1e-4)
    assert result.world_sizes == [2, 2]
    assert not [e for e in result.events if e["kind"] in ("worker_lost", "failure")]
    left = [e for e in result.events if e["kind"] == "worker_left"]
    assert [(e["rank"], e["cause"]) for e in left] == [(0, "preempted")], left
    resumed = [e for e in result.events if e["kind"] == "generation" and e["generation"] == first[0] + 1][0]
    assert resumed["resume_index"] == first[1], resumed


@pytest.fixture
def ray_3_cpus():
    """Room for both workers and the replacement of one that leaves under a notice."""
    start_ray(3)
    yield
    release_ray()


@pytest.mark.timeout(180)
def test_sigterm_to_rank_0_every_rank_sees_it_at_the_same_step_and_no_step_is_redone(ray_3_cpus, run_dirs):
    result = _trainer(run_dirs, sigterm_step=10).fit()
    _assert_seen_alike_and_nothing_redone(result, run_dirs)


@pytest.mark.timeout(120)
def test_preemptions_over_their_own_budget_fail_the_run_with_preemption_error(ray_3_cpus, run_dirs):
    with pytest.raises(PreemptionError) as failed:
        _trainer(run_dirs, FailureConfig(max_failures=5, max_preemption_failures=0), sigterm_step=4).fit()
    assert failed.value.preemption_info.preempted_ranks == [0]
    assert isinstance(failed.value, train.TrainingFailedError)


@pytest.mark.timeout(240)
def test_ray_draining_the_node_of_rank_0_is_a_notice_every_rank_sees(run_dirs):
    from ray.core.generated import autoscaler_pb2

    stop_ray()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env())
    try:
        join = fit_in_background(_trainer(run_dirs))
        first = wait_for(lambda: [p for p in read_progress(run_dirs["log_dir"]) if p["step"] >= 4 and p["rank"] == 0],
                         90, "rank 0 training")
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, why = gcs.drain_node(first[0]["node"], autoscaler_pb2.DrainNodeReason.Value(
            "DRAIN_NODE_REASON_PREEMPTION"), "spot instance reclaimed", int((time.time() + 60) * 1000))
        assert accepted, why
        result = join(180)
    finally:
        ray.shutdown()
        cluster.shutdown()
    _assert_seen_alike_and_nothing_redone(result, run_dirs)
    notice = [e for e in result.events if e["kind"] == "preemption_notice"]
    assert notice and notice[0]["source"] == "ray_drain" and notice[0]["node"] == first[0]["node"]


@pytest.mark.timeout(10)
def test_preemption_info_groups_ranks_by_node_with_the_earliest_deadline():
    assert preemption_info([]) is None
    info = preemption_info([Leaving(3, "b", None), Leaving(0, "a", 2000), Leaving(1, "a", 1000)])
    assert info.preempted_node_to_ranks == {"a": [0, 1], "b": [3]}
    assert info.deadline_ms == 1000 and info.preempted_ranks == [0, 1, 3] and info.preempted_node_ids == ["a", "b"]


@pytest.mark.timeout(10)
def test_the_preemption_budget_is_its_own():
    from elastic_train.supervisor.preemption.notices import Notices

    unlimited, one = Notices(-1), Notices(1)
    assert not any(unlimited.preempted() for _ in range(5))
    assert [one.preempted(), one.preempted()] == [False, True]
    assert FailureConfig().max_preemption_failures == -1
