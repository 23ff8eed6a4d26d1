"""`make demo`: a run on a simulated 3-node cluster that loses and regains workers.

A node is removed, a node is added, a worker process is SIGKILLed; the run shrinks, grows back and
finishes every step. `fit()` shows its live status line and the events that change the run; at the
end the demo draws the run's timeline (`elastic-train timeline`) to a PNG.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import ray
import torch
from ray.cluster_utils import Cluster

import elastic_train as et
from elastic_train.driver.launch import attach
from elastic_train.events import GenerationOpened, WorkerLost
from elastic_train.timeline import draw
from elastic_train.torch import prepare_model

log = logging.getLogger("elastic_train.demo")
STEPS = 300


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    start = 0
    checkpoint = et.get_checkpoint()
    if checkpoint is not None:
        state = checkpoint.to_dict()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = prepare_model(model)
    rank, world = et.get_context().get_world_rank(), et.get_context().get_world_size()
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    for step in range(start + 1, config["steps"] + 1):
        x = torch.randn(64 // world, 32, generator=torch.Generator().manual_seed(step * 10 + rank))
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_time"])
        et.report({"loss": loss.item(), "step": step, "world_size": world},
                  checkpoint=et.Checkpoint.from_dict(
                      {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}))


class OwnKillsQuiet:
    """Standard output without Ray's notice of a worker process that died mid-task, for the processes
    this demo killed itself: its own "** chaos" line already says so (Ray's driver prints every
    raylet's notice of a death to `sys.stdout`; any other line, and any other death, goes through)."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self.killed: set[int] = set()
        self._left_out = False  # the last write was a notice left out: its line's end goes too

    def write(self, text: str) -> int:
        left_out = self._left_out and text == "\n"
        self._left_out = "died or was killed" in text and any(f"Worker PID: {pid} " in text for pid in self.killed)
        return len(text) if left_out or self._left_out else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Monitor:
    """Attaches to the run's supervisor by name (as any process on the cluster can) and injects the
    demo's faults at their steps; `fit()` itself shows the run's progress.

    Runs in the main thread: Ray's `Cluster.add_node` installs signal handlers.
    """

    def __init__(self, cluster: Cluster, nodes: list, run_name: str, quiet: OwnKillsQuiet):
        self.cluster, self.nodes, self.run_name, self.quiet = cluster, nodes, run_name, quiet
        self.faults = [(60, "remove a node", self.remove_node), (120, "add a node", self.add_node),
                       (180, "SIGKILL rank 1's process", self.kill_rank1)]
        self.status: dict = {}

    def run(self, until) -> None:
        supervisor = None
        while not until():
            time.sleep(0.2)
            try:
                supervisor = supervisor or attach(self.run_name)
                self.status = ray.get(supervisor.status.options(max_task_retries=0).remote(), timeout=5)
            except (ValueError, ray.exceptions.RayError):
                continue
            step = self.status["metrics"].get("step", 0)
            if self.faults and step >= self.faults[0][0]:
                _, what, action = self.faults.pop(0)
                log.info("** chaos: %s", what)
                action()

    def remove_node(self) -> None:
        rank0_node = next(m["node"] for m in self.status["members"].values() if m["rank"] == 0)
        victim = next(n for n in self.nodes if n.node_id != rank0_node)
        self.nodes.remove(victim)
        self.cluster.remove_node(victim)

    def add_node(self) -> None:
        self.nodes.append(self.cluster.add_node(num_cpus=1))

    def kill_rank1(self) -> None:
        pid = next(m["pid"] for m in self.status["members"].values() if m["rank"] == 1)
        self.quiet.killed.add(pid)
        os.kill(pid, signal.SIGKILL)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    log.info("simulated cluster: head (0 CPUs) + 3 nodes of 1 CPU; training %d steps on (2, 3) workers", STEPS)
    storage = tempfile.mkdtemp(prefix="elastic_train_demo_")
    trainer = et.TorchTrainer(
        train_loop,
        train_loop_config={"steps": STEPS, "step_time": 0.05},
        scaling_config=et.ScalingConfig(num_workers=(2, 3)),
        run_config=et.RunConfig(name="demo", storage_path=storage),
    )
    outcome: dict = {}

    def fit_run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except et.TrainingFailedError as exc:
            outcome["error"] = exc

    fit = threading.Thread(target=fit_run, daemon=True)
    stdout = sys.stdout
    quiet = sys.stdout = OwnKillsQuiet(stdout)  # type: ignore[assignment]
    monitor = Monitor(cluster, nodes, "demo", quiet)
    started = time.monotonic()
    fit.start()
    try:
        monitor.run(until=lambda: not fit.is_alive())
    finally:
        fit.join()
        ray.shutdown()
        cluster.shutdown()
        sys.stdout = stdout
    if "error" in outcome:
        log.error("run failed: %s", outcome["error"])
        return 1
    result = outcome["result"]
    lost = [e["t"] for e in result.events if (w := WorkerLost.of(e)) and not w.spare]
    opened = [e["t"] for e in result.events if GenerationOpened.of(e)]
    log.info("finished %d steps in %.1f s; final loss %.4f", result.metrics["step"], time.monotonic() - started,
             result.metrics["loss"])
    log.info("world size by generation: %s", " -> ".join(map(str, result.world_sizes)))
    for t in lost:
        after = [o for o in opened if o >= t]
        if after:
            log.info("worker lost at t=%.2fs, new generation %.3f s later", t, after[0] - t)
    log.info("checkpoints: %s", result.path)
    picture = draw(result, Path(result.path) / "timeline.png")
    log.info("timeline: %s (elastic-train timeline %s -o timeline.png draws it again)", picture, result.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
