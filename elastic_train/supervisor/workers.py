"""The run's worker actors and their lifecycle: requested up to the maximum (a replacement away from
machines under a preemption notice), watched until they end, and, once lost, dropped and ended: a
frozen or hung process would keep its slot (its CPUs, its GPU), and no replacement could be placed."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY

from elastic_train.config import ElasticConfig, ScalingConfig
from elastic_train.protocol import Assignment, Stop
from elastic_train.supervisor.adoption import ACTOR_NAMESPACE, worker_name
from elastic_train.supervisor.membership import LostCause, WorkerRecord, WorkerStatus
from elastic_train.worker.actor import TrainWorker, WorkerSpec
from elastic_train.worker.nccl_env import nccl_env

logger = logging.getLogger(__name__)


def release(worker: WorkerRecord, place: Assignment | Stop) -> None:
    """Answer a parked worker's wait: its next place, or the end of its run."""
    if worker.waiting is not None and not worker.waiting.done():
        worker.waiting.set_result(place)
    worker.waiting = None


class WorkerPool:
    def __init__(
        self,
        spec: WorkerSpec,
        scaling: ScalingConfig,
        prefix: str,
        *,
        event: Callable[..., None],
        changed: Callable[[], None],
        track: Callable[[Coroutine[Any, Any, None]], None],
        over: Callable[[], bool],
    ):
        """`event(kind, **details)` records an event, `changed()` wakes the control loop, `track` runs
        a task, `over()` says the run has ended (nothing is requested or dropped then)."""
        self.records: dict[int, WorkerRecord] = {}
        self.next_id = 0
        self.leaving_nodes: set[str] = set()  # machines under a preemption notice
        self.supervisor: Any = None  # the supervisor's own handle, which workers call; set once it runs
        self._spec = spec
        self._elastic: ElasticConfig = spec.elastic
        self._scaling = scaling
        self._prefix = prefix
        self._event = event
        self._changed = changed
        self._track = track
        self._over = over
        self._class = ray.remote(TrainWorker)
        self._user_env: dict[str, str] = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}

    def with_status(self, status: WorkerStatus) -> list[WorkerRecord]:
        return [w for w in self.records.values() if w.status is status]

    def live_ids(self) -> set[int]:
        return {w.worker_id for w in self.records.values() if w.status is not WorkerStatus.LOST}

    def placeable_now(self) -> int:
        """How many workers the cluster's free resources could host right now."""
        need = self._scaling.worker_resources()
        free = ray.available_resources()
        return min(int(math.floor(free.get(k, 0.0) / v + 1e-9)) for k, v in need.items() if v > 0)

    def top_up(self) -> None:
        """Keep `max` worker actors alive or pending; pending ones start when capacity appears. A worker
        under a preemption notice is on its way out: its replacement is requested at once."""
        if self._over():
            return
        alive = [w for w in self.records.values() if w.status is not WorkerStatus.LOST and not w.leaving]
        resources = self._scaling.worker_resources()
        for _ in range(self._scaling.max_workers - len(alive)):
            worker_id = self.next_id
            self.next_id += 1
            actor = self._class.options(
                name=worker_name(self._prefix, worker_id),
                namespace=ACTOR_NAMESPACE,
                lifetime="detached",  # outlives a supervisor that Ray restarts (see adoption.py)
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                max_concurrency=6,
                scheduling_strategy="SPREAD" if "SPREAD" in self._scaling.placement_strategy else "DEFAULT",
                label_selector=self._away_from_leaving_nodes(),
                # NCCL: the c10d watchdog must not end a survivor's process (worker/nccl_env.py); set
                # before CUDA starts. Ray merges these into the job's env_vars; the user's own win.
                runtime_env={"env_vars": {**nccl_env(self._elastic.rendezvous_timeout_s), **self._user_env}}
                if self._spec.backend == "nccl" else None,
            ).remote(worker_id, self.supervisor, self._spec)
            self.watch(WorkerRecord(worker_id, actor), actor.run.remote())

    def watch(self, worker: WorkerRecord, ended_ref: Any) -> None:
        """Keep `worker` and follow it until `ended_ref` (its `run`, or `wait_stopped`) resolves."""
        self.records[worker.worker_id] = worker
        self._track(self._watch(worker, ended_ref))

    def _away_from_leaving_nodes(self) -> dict[str, str] | None:
        """Keep new workers off machines under a preemption notice, unless no other machine is left."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        leaving = self.leaving_nodes & alive
        if not leaving or not alive - leaving:
            return None
        return {NODE_ID_LABEL_KEY: f"!in({','.join(sorted(leaving))})"}

    async def _watch(self, worker: WorkerRecord, ended_ref: Any) -> None:
        """A dead actor is a lost worker. A worker whose run ended is killed: it is a detached actor,
        nothing else would end it; one that left under a preemption notice frees its slot for its
        replacement."""
        try:
            await ended_ref
        except ray.exceptions.RayActorError as exc:
            self.lose(worker, LostCause.DIED, f"actor died: {type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - a bug in the worker runtime itself
            self.lose(worker, LostCause.DIED, f"worker runtime failed: {exc!r}")
        else:
            ray.kill(worker.actor)
            if not worker.leaving:
                return
        worker.status = WorkerStatus.LOST
        worker.actor = None
        self.top_up()

    def lose(self, worker: WorkerRecord, cause: LostCause, reason: str) -> None:
        """Drop `worker` for `cause` (`reason` tells the details): it is fenced (its calls are refused
        from now on) and its process is ended."""
        if worker.status is WorkerStatus.LOST or self._over():
            return
        logger.warning("worker %d (pid %d) lost: %s", worker.worker_id, worker.pid, reason)
        self._event("worker_lost", worker_id=worker.worker_id, pid=worker.pid, rank=worker.rank,
                    node_id=worker.node_id, generation=worker.generation, cause=cause.value, reason=reason)
        worker.status, worker.lost_reason = WorkerStatus.LOST, reason
        if worker.actor is not None:
            ray.kill(worker.actor, no_restart=True)  # `_watch` requests the replacement once it ended
        self._changed()

    def drop_silent(self, now: float) -> None:
        """Heartbeats prove the process: one silent for `heartbeat_timeout_s` is lost."""
        for w in self.records.values():
            silent = now - w.last_heartbeat
            if w.status in (WorkerStatus.MEMBER, WorkerStatus.PARKED) and silent > self._elastic.heartbeat_timeout_s:
                self.lose(w, LostCause.SILENT, f"no heartbeat for {silent:.1f}s")

    async def probe(self, worker: WorkerRecord) -> None:
        """After a collective failed: is this member still there?"""
        try:
            await asyncio.wait_for(worker.actor.ping.remote(), self._elastic.probe_timeout_s)
        except ray.exceptions.RayActorError as exc:
            self.lose(worker, LostCause.DIED, f"liveness probe failed: {type(exc).__name__}")
        except asyncio.TimeoutError:
            self.lose(worker, LostCause.COLLECTIVE_FAILURE,
                      f"no answer to the liveness probe within probe_timeout_s={self._elastic.probe_timeout_s}s")

    def end_all(self, stop: Stop, now: bool) -> None:
        """The run is over: release every parked worker with `stop`; kill those still pending or lost
        (`now`: every one still there: detached actors, nothing else would end them)."""
        for w in self.records.values():
            release(w, stop)
            if w.actor is not None and (now or w.status in (WorkerStatus.PENDING, WorkerStatus.LOST)):
                ray.kill(w.actor)
