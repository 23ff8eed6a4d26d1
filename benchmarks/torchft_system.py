"""torchft 0.2.0 as a system of the benchmarks: the same workload (`common.build_model`, `train_step`'s
batches and simulated compute), in torchft's own recommended setup.

Setup (as torchft's train_ddp.py, and ../shared/peers/torchft/, where it was first run here): a
Lighthouse process (`torchft_lighthouse --min_replicas 1`, its default heartbeat timeout of 5 s); one
replica group per worker (group world size 1), each with its own TCPStore, a torchft
`ProcessGroupGloo`, a `Manager(min_replica_size=1)` whose state_dict / load_state_dict hold the model
and optimizer, `torchft.DistributedDataParallel` and `torchft.Optimizer`. A replica that (re)joins
heals from a live peer's state; torchft keeps no checkpoint in the loop. torchft relaunches nothing:
each replica is a Ray actor that Ray restarts when its process dies (`max_restarts=-1`), and the
driver calls its loop again, as Ray would relaunch a lost worker.

**Patched:** torchft 0.2.0 on gloo kills the *survivor* when a peer is SIGKILLed (its DDP comm hook
asserts on a managed future that is never set). `_safe_comm_hook` returns the bucket unchanged
instead; `should_commit()` then drops that step, as torchft intends. Every torchft figure is with it.

Each committed step is logged like the other systems' (`progress.jsonl`: start, time, pid, rank = the
replica's rank among the quorum's participants, world_size = their number, step = the manager's step
after the commit); a step that was not committed (a peer failed during it: torchft noticed the
fault) goes to `uncommitted.jsonl` with its time.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

from benchmarks.common import WIDTH, kill_if_due, batch, build_model, free_port, train_step

LIGHTHOUSE = str(Path(sys.executable).parent / "torchft_lighthouse")
PATCH = "torchft 0.2.0's DDP comm hook patched (else a peer's SIGKILL kills the survivor on gloo)"


def _safe_comm_hook(state, bucket):  # noqa: ANN001 - DDP checks the annotations: none, or dist.GradBucket
    """torchft.ddp's comm hook, returning the bucket unchanged when gloo's error left the managed
    future unset (the step is then not committed)."""
    import torch

    work = state.allreduce(bucket.buffer())
    work.wait()
    fut = work.get_future()
    if getattr(fut, "_fut", None) is None:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return fut._fut


@ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0)
class Replica:
    """One torchft replica group of one process (1 CPU, as each of the other systems' workers)."""

    def train(self, replica: int, lighthouse: str, config: dict[str, Any]) -> int:
        """Train until the manager's step reaches `config["steps"]`; returns it."""
        import torch.distributed as dist
        import torchft.ddp
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

        torchft.ddp.DistributedDataParallel._comm_hook = staticmethod(_safe_comm_hook)
        log = Path(config["log_dir"])
        model, optimizer = build_model(config.get("width", WIDTH))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
            load_state_dict=load_state_dict,
            state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            replica_id=f"replica_{replica}", lighthouse_addr=lighthouse, store_addr="127.0.0.1",
            store_port=store.port, rank=0, world_size=1, timeout=timedelta(seconds=30))
        ddp = DistributedDataParallel(manager, model)
        ft_optimizer = Optimizer(manager, optimizer)
        while manager.current_step() < config["steps"]:
            step = manager.current_step() + 1
            if replica == 1 and config.get("kills"):
                kill_if_due(log, step, config["kills"], config["kill_every"])
            began = time.time()
            x = batch(step, replica, config.get("width", WIDTH))
            train_step(ddp, ft_optimizer, x, config["step_time"])  # zero_grad starts the quorum
            committed = manager.current_step() == step
            record = {"start": began, "time": time.time(), "pid": os.getpid(), "step": step}
            if committed:
                record.update(rank=manager.participating_rank(), world_size=manager.num_participants())
            with open(log / ("progress.jsonl" if committed else "uncommitted.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        manager.shutdown(wait=False)
        return manager.current_step()


def uncommitted(log: Path) -> list[float]:
    """When the replicas' steps were not committed (torchft noticing a fault), from `uncommitted.jsonl`."""
    path = log / "uncommitted.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["time"] for line in path.read_text().splitlines() if line.strip()]


def _wait_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the torchft Lighthouse did not listen on {port} within {timeout_s} s")


def run(config: dict[str, Any], num_workers: int, workdir: Path) -> dict[str, Any]:
    """Run the workload under torchft on the connected Ray instance, relaunching killed replicas;
    returns the final step and the setup's facts."""
    port = free_port()
    with open(workdir / "lighthouse.log", "w") as out:
        lighthouse = subprocess.Popen([LIGHTHOUSE, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"],
                                      stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, 30)
        address = f"http://127.0.0.1:{port}"
        replicas = [Replica.remote() for _ in range(num_workers)]
        running = {replicas[i].train.remote(i, address, config): i for i in range(num_workers)}
        final, relaunched = 0, 0
        while running and final < config["steps"]:
            [done], _ = ray.wait(list(running))
            i = running.pop(done)
            try:
                final = max(final, ray.get(done))
            except ray.exceptions.RayActorError:  # its process died: Ray restarts the actor, we call it again
                relaunched += 1
                running[replicas[i].train.remote(i, address, config)] = i
        for i in running.values():  # the run is done: a replica relaunched late would train alone from step 0
            ray.kill(replicas[i], no_restart=True)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return {"final_step": final, "relaunched": relaunched, "patch": PATCH,
            "setup": "Lighthouse --min_replicas 1 (heartbeat timeout 5 s), a replica group per worker, "
                     "live-state healing, no checkpoint in the loop"}

