"""The run's metrics, exported through Ray (`ray.util.metrics`).

Ray's metrics agent (installed with `ray[default]`, as on every real Ray cluster) serves them on
each node's metrics export port to Prometheus, and the dashboard's Grafana panels read them there:
no server of ours. Ray prefixes every name with `ray_`. Every series carries the run's name (`run`);
per-worker ones its `rank` and `node` too. docs/operations/seeing_a_run.md lists them.

The supervisor records them all: it sees every event, report, upload and heartbeat of the run. What
it records is derived here from what it tells (`on_event`, `made`, `uploaded`, `sample`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from elastic_train.events import (CheckpointCommitted, Event, Failure, GenerationOpened, StateChanged, WorkerLeft,
                                  WorkerLost)
from elastic_train.protocol import Pace
from elastic_train.supervisor.membership import LostCause, WorkerRecord
from elastic_train.supervisor.state import RunState
from elastic_train.supervisor.watch.goodput import GoodputAccount

PREFIX = "elastic_train_"
WORKER_TAGS = ("run", "rank", "node")
SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]


def _gauge(name: str, description: str, tags: tuple[str, ...] = ("run",)) -> Gauge:
    return Gauge(PREFIX + name, description=description, tag_keys=tags)


def _counter(name: str, description: str, tags: tuple[str, ...] = ("run",)) -> Counter:
    return Counter(PREFIX + name, description=description, tag_keys=tags)


def _histogram(name: str, description: str, tags: tuple[str, ...] = ("run",)) -> Histogram:
    return Histogram(PREFIX + name, description=description, boundaries=SECONDS, tag_keys=tags)


class RunMetrics:
    """One run's metrics, recorded by its supervisor."""

    def __init__(self, run_name: str):
        self._run = {"run": run_name}
        self.account = GoodputAccount()
        self._world_size = _gauge("world_size", "Workers in the current generation.")
        self._generation = _gauge("generation", "The current generation (a new one at every membership change).")
        self._state = _gauge("state", "1 for the run's current state, 0 for the others.", ("run", "state"))
        self._steps_per_s = _gauge("steps_per_second", "Reports made per second, over the last ones.")
        self._goodput = _gauge("goodput", "Loop time of the steps that count over wall time since the first "
                                          "generation opened.")
        self._steps_redone = _counter("steps_redone", "Reports made again after a generation resumed before them.")
        self._recovery = _histogram("recovery_seconds", "From a fault (a member lost, a failure) to the next "
                                                        "report every member made.")
        self._lost = _counter("workers_lost", "Workers that left the run, by cause: "
                                              + ", ".join(c.value for c in LostCause) + ".", ("run", "cause"))
        self._step = _histogram("step_seconds", "A rank's loop time between reports, outside report() and "
                                                "other barriers.", WORKER_TAGS)
        self._stall = _histogram("report_stall_seconds", "How long report() held a rank's loop (waiting for "
                                                         "its peers, for upload room, for a SYNC commit).", WORKER_TAGS)
        self._upload_bytes = _counter("checkpoint_upload_bytes", "Bytes of checkpoint parts a rank stored.", WORKER_TAGS)
        self._upload = _histogram("checkpoint_upload_seconds", "Storing one rank's part of a checkpoint.", WORKER_TAGS)
        self._commit_bytes = _counter("checkpoint_committed_bytes", "Bytes of the checkpoints committed.")
        self._commit = _histogram("checkpoint_commit_seconds", "Checking a checkpoint's parts and writing its manifest.")
        self._heartbeat_age = _gauge("heartbeat_age_seconds", "Since a worker's last heartbeat.", WORKER_TAGS)
        self._rss = _gauge("worker_rss_bytes", "A worker's resident memory at its last report.", WORKER_TAGS)
        self._straggler = _gauge("straggler", "1 while a rank is flagged a straggler.", WORKER_TAGS)
        self._memory_growing = _gauge("memory_growing", "1 while a rank's memory keeps growing.", WORKER_TAGS)

    def on_event(self, event: Event, entry: Mapping[str, Any], now: float) -> None:
        """The supervisor recorded `event` (at monotonic time `now`)."""
        if isinstance(event, GenerationOpened):
            redone = self.account.opened(event.generation, event.resume_index or 0, now)
            if redone:
                self._steps_redone.inc(redone, self._run)
            self._world_size.set(event.world_size, self._run)
            self._generation.set(event.generation, self._run)
        elif isinstance(event, StateChanged):
            self.state(RunState(event.target))
        elif isinstance(event, WorkerLeft) or (isinstance(event, WorkerLost) and not event.spare):
            self._lost.inc(1, {**self._run, "cause": event.cause})
            self.account.lost(event.generation, event.rank, now)
        elif isinstance(event, Failure):
            self.account.fault(now)
        elif isinstance(event, CheckpointCommitted):
            if event.bytes:
                self._commit_bytes.inc(event.bytes, self._run)
            self._commit.observe(event.commit_s, self._run)

    def state(self, current: RunState) -> None:
        for state in RunState:
            self._state.set(float(state is current), {**self._run, "state": state.value})

    def made(self, index: int, paces: Mapping[int, Pace], members: Mapping[int, WorkerRecord], now: float) -> None:
        """Every member made report `index`; `paces` by worker id."""
        for worker_id, pace in paces.items():
            w = members.get(worker_id)
            if w is not None:
                tags = self._worker_tags(w)
                self._step.observe(pace.step_s, tags)
                if pace.stall_s > 0:  # 0.0: a generation's first report, no report before it
                    self._stall.observe(pace.stall_s, tags)
                self._rss.set(pace.rss, tags)
        recovered = self.account.made(index, [p.step_s for p in paces.values()], now)
        if recovered is not None:
            self._recovery.observe(recovered, self._run)

    def uploaded(self, w: WorkerRecord, nbytes: int, seconds: float) -> None:
        """Worker `w` stored its part of a checkpoint: `nbytes` in `seconds`."""
        tags = self._worker_tags(w)
        if nbytes:
            self._upload_bytes.inc(nbytes, tags)
        self._upload.observe(seconds, tags)

    def sample(self, members: Iterable[WorkerRecord], stragglers: set[int], growing: set[int], now: float) -> None:
        """What changes between events: heartbeat ages, flags, the step rate and goodput."""
        for w in members:
            tags = self._worker_tags(w)
            self._heartbeat_age.set(max(0.0, now - w.last_heartbeat), tags)
            self._straggler.set(float(w.worker_id in stragglers), tags)
            self._memory_growing.set(float(w.worker_id in growing), tags)
        self._steps_per_s.set(self.account.steps_per_s(), self._run)
        self._goodput.set(self.account.goodput(now), self._run)

    def _worker_tags(self, w: WorkerRecord) -> dict[str, str]:
        return {**self._run, "rank": str(w.rank), "node": w.node_id}
