"""A run the way real clusters run it: a head and two worker nodes started with the `ray start` CLI
as processes of their own, the training script submitted with `ray job submit`, one worker node lost
mid-run (its raylet and everything under it SIGKILLed by PID, as a machine that vanishes looks), and
`elastic-train status` attached to the live run from another process.

All on this machine, over loopback: each node has its own ports and agents; they share the disk, so a
local `storage_path` is storage every node sees (as an NFS mount would be).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import stop_ray
from tests.helpers import wait_for

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
STEPS = 60

TRAIN_SCRIPT = textwrap.dedent('''
    """train.py: a Ray Train program with `ray.train` -> `elastic_train` in its imports."""
    import json, os, sys, tempfile, time

    import ray
    import torch

    import elastic_train as train
    from elastic_train import Checkpoint, ElasticConfig, RunConfig, ScalingConfig
    from elastic_train.torch import TorchTrainer, prepare_model


    def train_func(config):
        torch.manual_seed(0)
        model = prepare_model(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        start = 0
        checkpoint = train.get_checkpoint()
        if checkpoint:
            with checkpoint.as_directory() as d:
                state = torch.load(os.path.join(d, "model.pt"))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
        ctx = train.get_context()
        for step in range(start + 1, config["steps"] + 1):
            g = torch.Generator().manual_seed(step * 100 + ctx.get_world_rank())
            x = torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(0.1)
            with open(os.path.join(config["log_dir"], f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "rank": ctx.get_world_rank(), "world": ctx.get_world_size(),
                                    "node": ray.get_runtime_context().get_node_id(), "time": time.time()}) + "\\n")
            metrics = {"loss": loss.item(), "step": step}
            if ctx.get_world_rank() == 0:
                with tempfile.TemporaryDirectory() as d:
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step}, os.path.join(d, "model.pt"))
                    train.report(metrics, checkpoint=Checkpoint.from_directory(d))
            else:
                train.report(metrics)


    if __name__ == "__main__":
        storage, log_dir = sys.argv[1], sys.argv[2]
        trainer = TorchTrainer(
            train_func,
            train_loop_config={"steps": %d, "log_dir": log_dir},
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="cli-run", storage_path=storage, elastic_config=ElasticConfig(verbosity=0)),
        )
        result = trainer.fit()
        print("FINISHED", json.dumps({"step": result.metrics["step"], "world_sizes": result.world_sizes}))
''' % STEPS)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _node_ports() -> list[str]:
    """The ports a node's agents would otherwise share with the other nodes on this machine."""
    listen, grpc, runtime_env, metrics = _free_ports(4)
    return [f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
            f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}"]


def _start_node(args: list[str], env: dict, log: Path, temp_dir: str) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own: the process and everything it starts; its
    output in `log`. Its files in `temp_dir`: in Ray's default one, the head's address file would make
    every later `ray.init()` on this machine look for this cluster once it is gone."""
    with open(log, "w") as out:
        return subprocess.Popen([str(BIN / "ray"), "start", "--block", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                                 *args, *_node_ports()],
                                env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def _lose_machine(node: subprocess.Popen) -> list[int]:
    """SIGKILL `ray start` and every process under it (its raylet, agents and workers) by PID."""
    processes = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
    for p in processes:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in processes]


def _stop(node: subprocess.Popen) -> None:
    """End a node and everything it started (SIGTERM would drain it for 30 s first)."""
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.wait()


def _progress(log_dir: Path) -> list[dict]:
    return [json.loads(line) for f in log_dir.glob("*.jsonl") for line in f.read_text().splitlines() if line]


@pytest.mark.timeout(300)
def test_ray_job_submit_on_a_ray_start_cluster_survives_a_lost_worker_node(tmp_path):
    stop_ray()  # nothing of this process's own Ray instance: the cluster below is the only one
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    gcs_port, dashboard_port = _free_ports(2)
    address, dashboard = f"127.0.0.1:{gcs_port}", f"http://127.0.0.1:{dashboard_port}"
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text(TRAIN_SCRIPT)
    log_dir, storage = tmp_path / "log", tmp_path / "storage"
    log_dir.mkdir()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    nodes = [_start_node(["--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--num-cpus=0",
                          "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                          f"--dashboard-port={dashboard_port}"], env, tmp_path / "head.log", temp_dir)]
    job = None
    try:
        wait_for(lambda: subprocess.run([str(BIN / "ray"), "status", f"--address={address}"], env=env,
                                        capture_output=True).returncode == 0, 60, "the head node")
        # Each worker machine has room for both workers: the one lost is replaced on the other. One
        # after the other: nodes starting at once on one machine race for the same ports.
        for i in range(2):
            nodes.append(_start_node([f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=2"], env,
                                     tmp_path / f"node-{i}.log", temp_dir))
            wait_for(lambda: f"/{2 * (i + 1)}.0 CPU" in subprocess.run(
                [str(BIN / "ray"), "status", f"--address={address}"], env=env, capture_output=True, text=True).stdout,
                     60, f"worker node {i} to join")
        job = subprocess.Popen(
            [str(BIN / "ray"), "job", "submit", f"--address={dashboard}", "--working-dir", str(tmp_path / "job"),
             "--", "python", "train.py", str(storage), str(log_dir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        def both_training() -> list[dict]:
            """Each rank's progress at step 5 or later in a world of 2, once both ranks have some (they
            log their steps separately: rank 0's alone may be there first)."""
            seen = [p for p in _progress(log_dir) if p["step"] >= 5 and p["world"] == 2]
            return seen if {p["rank"] for p in seen} == {0, 1} else []

        training = wait_for(both_training, 120, "both workers training")

        # From another process: the live run, every worker.
        status = subprocess.run([str(BIN / "elastic-train"), "status", "cli-run", "--address", address],
                                env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "cli-run: running" in status.stdout, status.stdout
        by_rank = {p["rank"]: p for p in training}
        assert all(str(p["node"])[:12] in status.stdout for p in by_rank.values()), status.stdout
        assert len([line for line in status.stdout.splitlines() if line.startswith("│")]) == 2, status.stdout

        # The machine of rank 1 is lost: its raylet and every process on it SIGKILLed.
        victim_node = by_rank[1]["node"]
        node_ids = {n.pid: _node_id(n) for n in nodes[1:]}
        victim = next(n for n in nodes[1:] if node_ids[n.pid] == victim_node)
        lost_at = time.time()
        _lose_machine(victim)
        out, _ = job.communicate(timeout=200)
        assert job.returncode == 0, out
        finished = json.loads(out.split("FINISHED ", 1)[1].splitlines()[0])
        assert finished["step"] == STEPS and finished["world_sizes"][-1] == 2, finished
        progress = _progress(log_dir)
        assert {p["step"] for p in progress if p["rank"] == 0} == set(range(1, STEPS + 1))
        after = [p for p in progress if p["time"] > lost_at + 1]
        assert after and all(p["node"] != victim_node for p in after), "a worker ran on the lost machine"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _node_id(node: subprocess.Popen) -> str:
    """The Ray node id of a node started by `ray start` (its raylet is one of its children)."""
    for child in psutil.Process(node.pid).children(recursive=True):
        for arg in child.cmdline():
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
    raise AssertionError(f"no raylet under ray start (pid {node.pid})")
