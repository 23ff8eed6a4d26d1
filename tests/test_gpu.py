"""The NCCL path, on whatever GPUs the machine has; skips cleanly on machines without one.

Faults on real processes: a rank SIGKILLed, a rank SIGSTOPped, training going on for minutes after a
recovery (c10d's watchdog used to end survivors ~60 s after: /work/shared/gpu/README.md), two
recoveries in a row, and a SIGKILL in a loop with no checkpoint whose state is kept live on the GPUs
(and, without Ray, a newcomer receiving such a state over the group). Each test also checks that no
survivor was lost on the way (a watchdog SIGABRT would show up as a lost worker).

With fewer GPUs than ranks, ranks share a GPU: each worker asks for a share of one, and gets its own
NCCL_HOSTID (`nccl_env.HOSTID_PER_PROCESS`), without which NCCL refuses two ranks on one device; they
then talk over sockets on the loopback interface.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import elastic_train as et
from elastic_train.worker.group.nccl_env import HOSTID_PER_PROCESS, nccl_env
from tests.conftest import ray_runtime_env, stop_ray
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import fault_once, log_progress, read_progress

gpus = torch.cuda.device_count()
RANKS = 3  # the multi-rank tests' world size
needs_gpu = pytest.mark.skipif(gpus < 1, reason="needs a GPU (NCCL)")
LONG_RUN_S = 180.0  # training after a recovery: the watchdog SIGABRT came ~60 s after one


@pytest.fixture
def gpu_ray():
    env = {**ray_runtime_env()["env_vars"], **nccl_env(), "NCCL_SOCKET_IFNAME": "lo"}
    if gpus < RANKS:
        env[HOSTID_PER_PROCESS] = "1"
    stop_ray()
    ray.init(num_gpus=gpus, num_cpus=RANKS + 2, runtime_env={"env_vars": env}, include_dashboard=False)
    yield
    ray.shutdown()


def _gpu_trainer(run_dirs: dict, num_workers: int | tuple[int, int], **config: Any) -> et.TorchTrainer:
    """A trainer on GPUs; with fewer GPUs than ranks, each worker asks for a share of one."""
    trainer = make_trainer(run_dirs, num_workers, use_gpu=True, **config)
    if gpus < RANKS:
        share = math.floor(100 / math.ceil(RANKS / gpus)) / 100  # a share never spans two GPUs
        trainer.scaling_config = dataclasses.replace(trainer.scaling_config, resources_per_worker={"GPU": share})
    return trainer


def _fault(run_dirs: dict, timeout_s: float) -> dict:
    fault_file = Path(run_dirs["log_dir"]) / "fault.json"
    return wait_for(lambda: fault_file.exists() and json.loads(fault_file.read_text() or "null"), timeout_s,
                    "the injected fault")


def _survivors_went_on(run_dirs: dict, victims: set[int], after: float) -> set[int]:
    """Pids that trained before `after` and again after it, in a later generation: survivors kept in place."""
    progress = read_progress(run_dirs["log_dir"])
    before = {p["pid"]: p["generation"] for p in progress if p["time"] < after and p["pid"] not in victims}
    return {p["pid"] for p in progress
            if p["pid"] in before and p["time"] > after and p["generation"] > before[p["pid"]]}


def _lost_pids(result: et.Result) -> set[int]:
    return {e["pid"] for e in result.events if e["kind"] == "worker_lost"}


@pytest.mark.timeout(180)
@needs_gpu
def test_nccl_worker_trains_on_its_gpu(gpu_ray, run_dirs):
    result = make_trainer(run_dirs, 1, use_gpu=True, steps=10).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 10


@pytest.mark.timeout(300)
@needs_gpu
def test_nccl_sigkill_of_a_rank_recovers_in_place(gpu_ray, run_dirs):
    result = _gpu_trainer(run_dirs, (1, RANKS), steps=60, step_time=0.1,
                          fault={"kind": "kill", "rank": 1, "at_step": 10}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 60
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    assert len(_survivors_went_on(run_dirs, {fault["pid"]}, fault["time"])) == RANKS - 1
    assert _lost_pids(result) == {fault["pid"]}


@pytest.mark.timeout(300)
@needs_gpu
def test_nccl_sigstop_of_a_rank_recovers_in_place(gpu_ray, run_dirs):
    """Survivors wait in an NCCL collective on the frozen rank until the supervisor aborts the generation."""
    elastic = et.ElasticConfig(heartbeat_timeout_s=3.0)
    result = _gpu_trainer(run_dirs, (1, RANKS), steps=60, step_time=0.1, elastic=elastic,
                          fault={"kind": "stop", "rank": 1, "at_step": 10, "point": "before_report"}).fit()
    assert result.error is None, result.error
    assert result.metrics["step"] == 60
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    assert len(_survivors_went_on(run_dirs, {fault["pid"]}, fault["time"])) == RANKS - 1
    assert _lost_pids(result) == {fault["pid"]}
    later = [p for p in read_progress(run_dirs["log_dir"]) if p["time"] > fault["time"]]
    assert fault["pid"] not in {p["pid"] for p in later}


@pytest.mark.timeout(600)
@needs_gpu
def test_nccl_survivors_train_three_minutes_after_a_recovery(gpu_ray, run_dirs):
    """c10d's watchdog ended survivors ~60 s after a peer died (stock settings); they must live on."""
    step_time = 0.25
    steps = 10 + int(LONG_RUN_S / step_time) + 40
    join = fit_in_background(_gpu_trainer(run_dirs, (1, RANKS), steps=steps, step_time=step_time,
                                          fault={"kind": "kill", "rank": 1, "at_step": 10}))
    fault = _fault(run_dirs, 120)
    result = join(LONG_RUN_S + 300)
    assert result.error is None, result.error
    assert result.metrics["step"] == steps
    survivors = _survivors_went_on(run_dirs, {fault["pid"]}, fault["time"])
    assert len(survivors) == RANKS - 1
    last = {p["pid"]: p["time"] for p in read_progress(run_dirs["log_dir"]) if p["pid"] in survivors}
    assert min(last.values()) - fault["time"] >= LONG_RUN_S, "a survivor stopped training early"
    assert _lost_pids(result) == {fault["pid"]}


@pytest.mark.timeout(600)
@needs_gpu
def test_nccl_two_recoveries_in_a_row(gpu_ray, run_dirs):
    """Rank 2 is killed by the loop; once the group re-formed and trained a few steps, the test kills
    the then rank 1 as well: rank 0's process goes through both recoveries."""
    join = fit_in_background(_gpu_trainer(run_dirs, (1, RANKS), steps=120, step_time=0.2,
                                          fault={"kind": "kill", "rank": 2, "at_step": 10}))
    first = _fault(run_dirs, 120)

    def reformed_and_trained() -> list[dict]:
        progress = read_progress(run_dirs["log_dir"])
        generation = max((p["generation"] for p in progress if p["time"] < first["time"]), default=None)
        return [p for p in progress if p["time"] > first["time"] and generation is not None
                and p["generation"] > generation and p["rank"] == 1 and p["step"] >= first["step"] + 5]

    second = wait_for(reformed_and_trained, 180, "the group to re-form and train")[0]
    os.kill(second["pid"], signal.SIGKILL)
    result = join(400)
    assert result.error is None, result.error
    assert result.metrics["step"] == 120
    victims = {first["pid"], second["pid"]}
    assert _lost_pids(result) == victims
    rank0 = {p["pid"] for p in read_progress(run_dirs["log_dir"]) if p["rank"] == 0 and p["time"] < first["time"]}
    assert rank0 <= _survivors_went_on(run_dirs, victims, second["time"]), "rank 0 did not survive both recoveries"


KEPT_BATCH = 12  # a step's global batch: split evenly at 1, 2 or 3 ranks


def _kept_state_batch(step: int) -> torch.Tensor:
    return torch.randn(KEPT_BATCH, 16, generator=torch.Generator().manual_seed(step))


def _kept_state_loop(config: dict) -> None:
    """No checkpoint, the model and optimizer kept live on the GPU; each rank takes its share of a
    seeded global batch, so the math does not depend on the world size. Logs the weights each step."""
    from elastic_train.torch import get_device, prepare_model

    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(16, 1), live_state=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = et.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    per = KEPT_BATCH // world
    for step in range(ctx.get_resume_index() + 1, config["steps"] + 1):
        fault_once(config, step, rank)
        loss = model(_kept_state_batch(step)[rank * per:(rank + 1) * per].to(get_device())).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_time"])
        log_progress(config["log_dir"], rank=rank, world=world, generation=ctx.get_generation(), step=step,
                     weight=model.module.weight.detach().flatten().cpu().tolist())
        et.report({"step": step})


def _kept_state_reference(steps: int) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(1, steps + 1):
        loss = model(_kept_state_batch(step)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.weight.detach().flatten().tolist()


@pytest.mark.timeout(300)
@needs_gpu
def test_nccl_sigkill_with_the_state_kept_live_loses_no_step(gpu_ray, run_dirs):
    """No checkpoint in the loop: the survivors resume from the state they hold on their GPUs, the
    replacement gets it from a survivor, no step is redone, and the run ends with a fault-free run's
    weights."""
    steps = 60
    result = _gpu_trainer(run_dirs, (1, RANKS), loop=_kept_state_loop, steps=steps, step_time=0.1,
                          fault={"kind": "kill", "rank": 1, "at_step": 10}).fit()
    assert result.error is None, result.error
    fault = json.loads((Path(run_dirs["log_dir"]) / "fault.json").read_text())
    assert len(_survivors_went_on(run_dirs, {fault["pid"]}, fault["time"])) == RANKS - 1
    assert _lost_pids(result) == {fault["pid"]}
    after = [e for e in result.events if e["kind"] == "generation" and e["time"] > fault["time"]]
    assert (after[0]["resume_from"], after[0]["resume_index"]) == ("memory", 9)
    rank0 = [p for p in read_progress(run_dirs["log_dir"]) if p.get("rank") == 0 and "step" in p]
    assert sorted(p["step"] for p in rank0) == list(range(1, steps + 1)), "a step was redone or skipped"
    last = max(rank0, key=lambda p: p["step"])
    torch.testing.assert_close(torch.tensor(last["weight"]), torch.tensor(_kept_state_reference(steps)),
                               rtol=1e-4, atol=1e-5)
    assert result.checkpoint is None


def _share_rank(rank: int, world: int, port: int, conn: Any) -> None:
    """Rank 0 holds a kept state on its GPU (Adam: CUDA tensors, and a CPU `step`); the others receive it."""
    import socket

    import torch.distributed as dist

    from elastic_train.worker.hold.state_transfer import share

    try:
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-{os.getpid()}"  # ranks may share a GPU
        device = torch.device("cuda", rank % gpus)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 256, device=device)).sum().backward()
        optimizer.step()
        want = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()]}
        got = share(want if rank == 0 else None)
        state, want_state = got["optimizers"][0]["state"], want["optimizers"][0]["state"]
        same = all(torch.equal(got["model"][k], v) for k, v in want["model"].items()) and all(
            torch.equal(state[i][k].cpu(), v.cpu()) and state[i][k].device == v.device
            for i in want_state for k, v in want_state[i].items())
        conn.send({"same": same, "received": got is not want})
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send({"error": repr(exc)})


@pytest.mark.timeout(120)
@needs_gpu
def test_nccl_a_newcomer_receives_the_kept_state_over_the_group():
    """state_transfer.share under NCCL: the CUDA tensors come over the group, onto the receiver's GPU;
    a CPU tensor (Adam's step) in the pickled outline. (On an H200: 192 MB of Adam state in 0.06 s.)"""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_share_rank, args=(r, 2, port, pipes[r][1]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = [receiver.recv() if receiver.poll(90) else {"error": "no result in time"} for receiver, _ in pipes]
    finally:
        for p in procs:
            p.kill()
            p.join(30)
    assert results == [{"same": True, "received": False}, {"same": True, "received": True}], results


@pytest.mark.timeout(300)
@needs_gpu
def test_fsdp2_kept_state_is_resharded_under_nccl(gpu_ray, run_dirs):
    """tests/test_fsdp.py's first case on the GPUs: an FSDP2 transformer stack at 3 ranks over NCCL,
    rank 1 SIGKILLed at step 8; the survivors re-shard the last report's state from their shares
    (copied to host memory) onto their GPUs at 2, and a replacement joins at 3. The restored
    parameters equal the reported ones bit for bit; the losses are the CPU reference's within 1e-3
    (the GPU's kernels round differently)."""
    from tests.test_fsdp import fit

    share = 1.0 if gpus >= RANKS else math.floor(100 / math.ceil(RANKS / gpus)) / 100
    result, generations, timeline = fit(run_dirs, (2, RANKS), [{"step": 8, "ranks": [1]}], gpu_share=share,
                                        tolerance=1e-3)
    assert [e["world_size"] for e in generations][:2] == [RANKS, 2], timeline
    assert generations[1]["resume_from"] == "memory", timeline

