"""Warm spares (`ElasticConfig.warm_spares_per_node`): a run at its full size keeps a worker process
ready beside its workers, and one SIGKILLed on a live node is replaced by it at once. The replacement
takes the lost rank's number, the survivors keep theirs, and the run computes what a fault-free run
computes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from ray.util.placement_group import placement_group_table

import elastic_train as et
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.run_folder.event_log import read_events
from elastic_train.torch import prepare_model
from tests.helpers import fit_in_background, wait_for
from tests.loops import log_progress, read_progress

STEPS, LR = 150, 0.01


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def spare_loop(config: dict) -> dict | None:
    """The same step on every rank (its result does not depend on the world size): with `live_state` the
    model and optimizer are kept live and no checkpoint is reported; else rank 0 reports a checkpoint
    every `every` steps (an epoch's), which the loop loads when it is re-entered."""
    live = config["live_state"]
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    ctx = et.get_context()
    done = ctx.get_resume_index()
    checkpoint = None if live else et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        done = state["step"]
    model = prepare_model(net, live_state=live)
    for step in range(done + 1, STEPS + 1):
        time.sleep(config["step_time"])
        _step(model, optimizer)
        log_progress(config["log_dir"], step=step, rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                     generation=ctx.get_generation())
        saved = not live and step % config["every"] == 0 and ctx.get_world_rank() == 0
        et.report({"step": step}, checkpoint=et.Checkpoint.from_dict(
            {"model": net.state_dict(), "optimizer": optimizer.state_dict(), "step": step}) if saved else None)
    return {k: v.detach().clone() for k, v in net.state_dict().items()} if ctx.get_world_rank() == 0 else None


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        _step(net, optimizer)
    return net.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_workers, live_state, killed", [(3, True, 2), (3, True, 0), (3, False, 1), ((2, 3), True, 1),
                                                         (4, True, 1)],
                         ids=["kept-state-rank-2", "kept-state-rank-0", "epoch-checkpoint-rank-1",
                              "range-kept-state-rank-1", "full-node-kept-state-rank-1"])
def test_a_worker_killed_on_a_live_node_is_replaced_by_the_warm_spare_at_once(data_ray, run_dirs, num_workers,
                                                                             live_state, killed):
    """Three workers on a 4-CPU node: the run starts its spare there once it is at full size (four: on
    a node with no CPU free, the spare holds nothing and takes over the bundle the lost worker's place
    keeps). A rank SIGKILLed after the spare is ready: the run is back at full size within 1 s of the kill, in the
    first generation after it, the spare at the lost rank, the survivors at theirs. With the state kept
    live nothing is stored and nothing is lost; with a checkpoint an epoch the loops re-enter from it, as
    Ray Train's restart at full size does, rather than going on at 2 until a replacement is started. A
    range `(2, 3)` with its state kept live takes its spare at the loss too (its survivors' last report
    is the newest kept state), rather than going on at 2 and re-forming at the next report. Every bundle
    the run reserved is given back once it ended."""
    size = num_workers if isinstance(num_workers, int) else num_workers[1]
    trainer = et.TorchTrainer(
        spare_loop, train_loop_config={"log_dir": run_dirs["log_dir"], "live_state": live_state, "every": 30,
                                       "step_time": 0.1},
        scaling_config=et.ScalingConfig(num_workers=num_workers),
        run_config=et.RunConfig(name="run", storage_path=run_dirs["storage"],
                                elastic_config=et.ElasticConfig(warm_spares_after_s=0)))  # its spare from the start
    join = fit_in_background(trainer)
    path = os.path.join(run_dirs["storage"], "run")

    def events() -> list[dict]:
        return read_events(RunStorage.at(path)) if os.path.exists(path) else []

    def spare_ready() -> dict | None:
        seen = events()
        first = next((e for e in seen if e["kind"] == "generation"), None)
        return first and next((e for e in seen if e["kind"] == "worker_ready"
                               and str(e["worker_id"]) not in map(str, first["members"])), None)

    ready = wait_for(spare_ready, 60, "the warm spare to be ready")
    first = next(e for e in events() if e["kind"] == "generation")
    wait_for(lambda: max((p["step"] for p in read_progress(run_dirs["log_dir"])), default=0) > 35, 60,
             "a step past the first epoch's checkpoint")
    at_kill = max(p["step"] for p in read_progress(run_dirs["log_dir"]))
    assert at_kill < STEPS - 20, "the run was nearly over before its spare was ready"
    victim = next(m for m in first["members"].values() if m["rank"] == killed)
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    result = join(180)

    assert result.error is None, result.error
    final = result.return_value if live_state else result.checkpoint.to_dict()["model"]
    for name, value in _reference().items():
        torch.testing.assert_close(final[name], value)
    after = [e for e in result.events if e["kind"] == "generation" and e["time"] > killed_at]
    back = after[0]
    assert back["world_size"] == size and back["time"] - killed_at <= 1.0, (killed_at, after)
    print(f"kill -> back at {size} workers: {back['time'] - killed_at:.3f} s")
    ranks = {str(w): m["rank"] for w, m in back["members"].items()}
    assert ranks[str(ready["worker_id"])] == killed  # the spare, ready before the kill, at the lost rank
    assert all(ranks[w] == m["rank"] for w, m in first["members"].items() if m["rank"] != killed)
    assert back["resume_from"] == "memory"
    wait_for(lambda: not [g for g in placement_group_table().values() if g["state"] != "REMOVED"], 10,
             "the run's bundles to be given back")
    if live_state:
        assert RunStorage.at(result.path).committed() == []
        assert back["resume_index"] >= at_kill  # nothing before the kill's step is redone
    else:
        # the epoch's checkpoint (one more step may have run as the kill came), as Ray Train restarts from it
        assert back["resume_index"] in {30 * (at_kill // 30), 30 * ((at_kill + 1) // 30)}
