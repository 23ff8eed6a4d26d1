"""The faults: each breaks one thing the way the world does, on the target's own node.

Process signals are sent by a zero-CPU Ray task pinned to the target's node, so the harness works
the same on a simulated cluster and on a real one. A fault that lasts (a hang, a preemption notice,
a storage outage) arms a timer that ends it; the timer is the fault's duration, not a wait.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chaos.log import FaultLog
from chaos.storage_proxy import FaultyStorageProxy, StorageFaults
from chaos.targets import Member, RunHandle


@ray.remote(num_cpus=0, max_retries=0)
def _send_signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _kill_raylet() -> int:
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "raylet":
            proc.kill()
            return proc.pid
    return -1


def signal_process(member: Member, signum: int) -> bool:
    """Send `signum` to the member's process, from its own node."""
    strategy = NodeAffinitySchedulingStrategy(member.node, soft=False)
    return ray.get(_send_signal.options(scheduling_strategy=strategy).remote(member.pid, signum))


@dataclass
class ChaosContext:
    """What faults act on: the run, optionally a simulated cluster and a storage proxy."""

    run: RunHandle
    log: FaultLog
    cluster: Any = None  # ray.cluster_utils.Cluster, for node faults on a simulated cluster
    node_args: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1})
    proxy: FaultyStorageProxy | None = None
    timers: list[threading.Timer] = field(default_factory=list)

    def later(self, delay_s: float, action: Callable[[], Any]) -> None:
        timer = threading.Timer(delay_s, action)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def cancel_timers(self) -> None:
        for timer in self.timers:
            timer.cancel()


def kill_actor(ctx: ChaosContext, targets: list[Member], **_: Any) -> None:
    """`ray.kill` the worker actors: Ray sees them die."""
    for m in targets:
        ray.kill(ctx.run.actor(m), no_restart=True)
        ctx.log.record("kill-actor", m.__dict__)


def sigkill(ctx: ChaosContext, targets: list[Member], **_: Any) -> None:
    """SIGKILL the worker processes: a crash, no goodbye."""
    for m in targets:
        signal_process(m, signal.SIGKILL)
        ctx.log.record("sigkill", m.__dict__)


def hang(ctx: ChaosContext, targets: list[Member], hang_s: float = 8.0, **_: Any) -> None:
    """SIGSTOP the worker processes, SIGCONT them `hang_s` later: a freeze, or a partition that heals."""
    for m in targets:
        signal_process(m, signal.SIGSTOP)
        ctx.log.record("hang", m.__dict__, hang_s=hang_s)
        ctx.later(hang_s, lambda m=m: (signal_process(m, signal.SIGCONT), ctx.log.record("resume", m.__dict__)))


def preempt(ctx: ChaosContext, targets: list[Member], notice_s: float = 5.0, **_: Any) -> None:
    """A spot preemption: the notice (SIGTERM, as a node shutdown sends), then SIGKILL `notice_s` later."""
    for m in targets:
        signal_process(m, signal.SIGTERM)
        ctx.log.record("preempt-notice", m.__dict__, notice_s=notice_s)
        ctx.later(notice_s, lambda m=m: (signal_process(m, signal.SIGKILL), ctx.log.record("preempt-kill", m.__dict__)))


def lose_node(ctx: ChaosContext, targets: list[Member], **_: Any) -> None:
    """Lose the targets' nodes: `remove_node` on a simulated cluster, else kill the node's raylet."""
    for node_id in sorted({m.node for m in targets}):
        if ctx.cluster is not None:
            node = next(n for n in ctx.cluster.list_all_nodes() if n.node_id == node_id)
            ctx.cluster.remove_node(node)
        else:
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            ray.get(_kill_raylet.options(scheduling_strategy=strategy).remote())
        ctx.log.record("lose-node", node_id, ranks=[m.rank for m in targets if m.node == node_id])


def add_node(ctx: ChaosContext, targets: list[Member], **_: Any) -> None:
    """Add a node to the simulated cluster (capacity appears)."""
    if ctx.cluster is None:
        raise ValueError("add-node needs a simulated cluster (ray.cluster_utils.Cluster)")
    node = ctx.cluster.add_node(**ctx.node_args)
    ctx.log.record("add-node", node.node_id, **ctx.node_args)


def kill_supervisor(ctx: ChaosContext, targets: list[Member], **_: Any) -> None:
    """Kill the run's supervisor actor (Ray restarts it)."""
    ray.kill(ctx.run.supervisor, no_restart=False)
    ctx.log.record("kill-supervisor", ctx.run.name)


def storage_outage(ctx: ChaosContext, targets: list[Member], outage_s: float = 5.0,
                   faults: StorageFaults | None = None, **_: Any) -> None:
    """Break storage through the proxy for `outage_s` (default: every upload answered 503)."""
    if ctx.proxy is None:
        raise ValueError("storage faults need a FaultyStorageProxy in front of the storage endpoint")
    chosen = faults or StorageFaults(error_rate=1.0, error_status=503, methods=frozenset({"PUT", "POST"}))
    ctx.proxy.set_faults(chosen)
    ctx.log.record("storage", ctx.proxy.url, faults=str(chosen), outage_s=outage_s)
    ctx.later(outage_s, lambda: (ctx.proxy.clear(), ctx.log.record("storage-restored", ctx.proxy.url)))


FAULTS: dict[str, Callable[..., None]] = {
    "kill-actor": kill_actor,
    "sigkill": sigkill,
    "hang": hang,
    "preempt": preempt,
    "lose-node": lose_node,
    "add-node": add_node,
    "kill-supervisor": kill_supervisor,
    "storage": storage_outage,
}
