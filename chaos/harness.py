"""Runs a fault schedule against a live run: waits for each firing (on an event, so `stop()` ends
it at once), picks the targets, injects, logs."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable

from chaos.faults import FAULTS, ChaosContext
from chaos.schedules import Firing
from chaos.targets import pick

logger = logging.getLogger(__name__)


class ChaosRunner:
    """Injects `fault` at each of `firings` into `ctx.run`, hitting `target` (see `targets.py`).

    Firings from a replayed trace carry their own action: "add" adds a node, "remove" loses the
    node that the trace's node name was mapped to (the n-th added trace node is the n-th cluster
    node the harness added; starting nodes are taken over in order)."""

    def __init__(self, ctx: ChaosContext, firings: list[Firing], fault: str = "sigkill", target: str = "random",
                 seed: int = 0, ready: Callable[[float], bool] | None = None, ready_poll_s: float = 0.1,
                 **fault_args: Any):
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(sorted(FAULTS))}")
        self.ctx, self.firings, self.fault, self.target = ctx, firings, fault, target
        self.fault_args = fault_args
        self.ready, self.ready_poll_s = ready, ready_poll_s
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._trace_nodes: dict[str, str] = {}  # trace node name -> Ray node id
        self._thread: threading.Thread | None = None

    def start(self) -> "ChaosRunner":
        self._thread = threading.Thread(target=self.run, name="chaos", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.ctx.cancel_timers()

    def run(self) -> None:
        started, fired_at = time.monotonic(), None
        for firing in self.firings:
            if self._stop.wait(max(0.0, started + firing.at_s - time.monotonic())):
                return
            if fired_at is not None and not self._await_ready(fired_at):
                return
            fired_at = time.time()
            try:
                self._fire(firing)
            except Exception:  # noqa: BLE001 - a fault that cannot be injected is logged, the schedule goes on
                logger.exception("chaos: could not inject %s", firing)

    def _await_ready(self, fired_at: float) -> bool:
        """With `ready`, a firing also waits until `ready(wall time of the previous firing)` holds (the run
        recovered from it, as the scenario defines it): faults that a design survives one at a time are
        not stacked. False if the harness was stopped meanwhile."""
        while self.ready is not None and not self.ready(fired_at):
            if self._stop.wait(self.ready_poll_s):
                return False
        return True

    def _fire(self, firing: Firing) -> None:
        if firing.action in ("add", "remove") and self.ctx.cluster is None:
            logger.warning("chaos: trace %s of %s skipped: node events need a simulated cluster", firing.action,
                           firing.node)
            return
        if firing.action == "add":
            node = self.ctx.cluster.add_node(**self.ctx.node_args)
            self._trace_nodes[firing.node] = node.node_id
            self.ctx.log.record("add-node", node.node_id, trace_node=firing.node)
            return
        if firing.action == "remove":
            node_id = self._trace_nodes.pop(firing.node, None)
            node = next((n for n in self.ctx.cluster.list_all_nodes() if n.node_id == node_id), None)
            if node is not None:
                self.ctx.cluster.remove_node(node)
                self.ctx.log.record("lose-node", node_id, trace_node=firing.node)
            return
        members = self.ctx.run.members()
        targets = pick(self.target, members, self._rng)
        if not targets and self.fault not in ("add-node", "kill-supervisor", "storage"):
            logger.warning("chaos: no member matches %r now; %s skipped", self.target, self.fault)
            return
        FAULTS[self.fault](self.ctx, targets, **self.fault_args)

    def adopt_nodes(self, trace_names: list[str], node_ids: list[str]) -> None:
        """Map trace node names that exist at the start onto existing cluster nodes."""
        self._trace_nodes.update(zip(trace_names, node_ids))
