"""The roster: the run's workers and their records, and the only code that changes a `WorkerRecord`.

Workers are requested up to the maximum (a replacement away from machines under a preemption notice),
each in a bundle of its own (bundles.py), and warm spares beside a run at its full size
(placement.spare_nodes: one parks until it takes the place, and the bundle, of a worker lost on its
node); all are watched until they end, and, once lost, dropped and ended: a frozen or hung process
would keep its slot (its CPUs, its GPU), and no replacement could be placed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Mapping

import ray
import ray._private.state
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic_train.config import ElasticConfig, ScalingConfig
from elastic_train.events import FencedWorkerRejoined, SupervisorRestarted, WorkerLeft, WorkerLost
from elastic_train.protocol import Assignment, Outcome, Stop, WorkerInfo
from elastic_train.run_spec import WorkerSpec
from elastic_train.supervisor import bundles, placement, policy
from elastic_train.supervisor.adoption import ACTOR_NAMESPACE, describe_workers, worker_name
from elastic_train.supervisor.membership import LostCause, WorkerRecord, WorkerStatus
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry
from elastic_train.worker.actor import TrainWorker
from elastic_train.worker.group.nccl_env import nccl_env

logger = logging.getLogger(__name__)


def _answer(worker: WorkerRecord, place: Assignment | Stop) -> None:
    """Answer a parked worker's wait: its next place, or the end of its run."""
    if worker.waiting is not None and not worker.waiting.done():
        worker.waiting.set_result(place)
    worker.waiting = None


class Roster:
    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, prefix: str, telemetry: Telemetry, tasks: Tasks,
                 wake: asyncio.Event):
        """`wake` is set whenever a worker's record changed in a way the control loop acts on."""
        self.records: dict[int, WorkerRecord] = {}
        self.next_id = 0
        self.leaving_nodes: set[str] = set()  # machines under a preemption notice
        self.supervisor: Any = None  # the supervisor's own handle, which workers call; set once it runs
        self.over = False  # the run ended: nothing is requested or dropped any more
        self._spec = spec
        self._elastic: ElasticConfig = spec.elastic
        self._scaling = scaling
        self._prefix = prefix
        self._telemetry = telemetry
        self._tasks = tasks
        self._wake = wake
        self._class = ray.remote(TrainWorker)
        self._user_env: dict[str, str] = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
        self._spares_from = time.monotonic() + spec.elastic.warm_spares_after_s  # ElasticConfig.warm_spares_after_s
        self._need = scaling.worker_resources()  # what each worker asks of Ray (no zeros: ScalingConfig)
        self._spares_hold = placement.spare_holds_its_own(self._need)  # else they take bundles over

    def with_status(self, status: WorkerStatus) -> list[WorkerRecord]:
        return [w for w in self.records.values() if w.status is status]

    def members(self, generation: int) -> list[WorkerRecord]:
        return [w for w in self.records.values() if w.is_member(generation)]

    def ready(self) -> list[WorkerRecord]:
        """Workers parked and ready for the next generation: each with a place (a spare once it took
        a lost worker's), none under a preemption notice."""
        return [w for w in self.with_status(WorkerStatus.PARKED) if not w.leaving and w.slot >= 0]

    def standby(self, generation: int) -> list[WorkerRecord]:
        """Workers parked beside `generation` with a place in the run, not members of it."""
        return [w for w in self.with_status(WorkerStatus.PARKED) if not w.is_member(generation) and w.slot >= 0]

    def live_ids(self) -> set[int]:
        return {w.worker_id for w in self.records.values() if w.status is not WorkerStatus.LOST}

    def holds(self) -> dict[int, set[tuple[int, int, str]]]:
        """What each parked worker holds in memory (it told at parking; copies it took since are added)."""
        return {w.worker_id: w.holds for w in self.with_status(WorkerStatus.PARKED)}

    def placeable_now(self) -> int:
        """How many workers the cluster's free resources could host right now, on nodes their label
        selectors allow."""
        by_free = min(placement.fits(self._need, ray.available_resources()), self._scaling.max_workers)
        if self._scaling.label_selector is None:
            return by_free
        return min(by_free, placement.placeable(self._need, self._alive_nodes(), self._scaling.label_selector,
                                                self._scaling.max_workers))

    def top_up(self) -> None:
        """Keep `max` worker actors alive or pending; pending ones start when capacity appears. A worker
        under a preemption notice is on its way out: its replacement is requested at once. A run with
        all of them alive gets its warm spares."""
        if self.over:
            return
        alive = [w for w in self.records.values() if w.status is not WorkerStatus.LOST and not w.leaving]
        filled = [w for w in alive if w.slot >= 0]  # a spare has no place until it takes a lost worker's
        slots = placement.free_slots({w.slot for w in filled}, self._scaling.max_workers,
                                     self._scaling.max_workers - len(filled))
        if not slots:
            self._add_spares(alive)
            return
        alive_nodes = self._alive_nodes()
        holding = alive if self._spares_hold else filled  # what takes the nodes' room
        placed = Counter(w.node_id or w.planned_node for w in holding)
        choose = placement.spread_node if "SPREAD" in self._scaling.placement_strategy else placement.pack_node
        for slot in slots:
            nodes, selector = placement.avoiding(alive_nodes, self.leaving_nodes,
                                                 placement.selector_for(self._scaling.label_selector, slot))
            node = choose(self._need, nodes, placed)
            placed[node] += 1
            self._start(slot, node or "", selector)

    def _add_spares(self, alive: list[WorkerRecord]) -> None:
        """Warm spares beside the run's workers (placement.spare_nodes), once none of its own is pending:
        each pinned to its node, where it replaces a worker lost there."""
        per_node = self._elastic.warm_spares_per_node
        if (not per_node or not isinstance(self._scaling.label_selector, (Mapping, type(None)))
                or time.monotonic() < self._spares_from
                or any(w.status is WorkerStatus.PENDING and w.slot >= 0 for w in alive)):
            return
        hosts = {w.node_id for w in alive if w.status is WorkerStatus.TRAINING} - self.leaving_nodes
        spares = Counter(w.node_id or w.planned_node for w in alive if w.slot < 0)
        if not hosts or all(spares[node] >= per_node for node in hosts):
            return
        free = ray._private.state.available_resources_per_node()  # a DeveloperAPI: what each node has free now
        leave = {"CPU": 1.0} if self._spec.with_datasets else {}  # Ray Data's tasks go on beside a spare
        for node in placement.spare_nodes(self._need, free, hosts, spares, per_node, leave):
            self._start(-1, node, {})

    def _start(self, slot: int, node: str, selector: dict[str, str]) -> None:
        """Request one worker actor for `slot`, in a bundle of its own on `node` where it has room
        (else where Ray places it); or a warm spare (-1) pinned to `node`, holding a worker's resources
        only where `placement.spare_holds_its_own`."""
        worker_id = self.next_id
        self.next_id += 1
        need = self._need
        bundle = bundles.reserve(bundles.name_of(self._prefix, worker_id), need, node, selector) if slot >= 0 else None
        holds = slot >= 0 or self._spares_hold
        resources = need if holds else {}
        env = dict(nccl_env(self._elastic.rendezvous_timeout_s)) if self._spec.backend == "nccl" else {}
        if not holds and int(need.get("CPU", 0)) > 1:
            env["OMP_NUM_THREADS"] = str(int(need["CPU"]))  # as Ray sets it for the worker it may replace
        actor = self._class.options(
            name=worker_name(self._prefix, worker_id),
            namespace=ACTOR_NAMESPACE,
            lifetime="detached",  # outlives a supervisor that Ray restarts (see adoption.py)
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
            max_concurrency=6,
            scheduling_strategy=bundles.inside(bundle) if bundle is not None else
            NodeAffinitySchedulingStrategy(node, soft=False) if slot < 0 else "DEFAULT",
            label_selector=selector if selector and bundle is None else None,
            # NCCL: the c10d watchdog must not end a survivor's process (worker/group/nccl_env.py); set
            # before CUDA starts. Ray merges these into the job's env_vars; the user's own win.
            runtime_env={"env_vars": {**env, **self._user_env}} if env else None,
        ).remote(worker_id, self.supervisor, self._spec)
        self.watch(WorkerRecord(worker_id, actor, slot=slot, planned_node=node, bundle=bundle), actor.run.remote())

    def watch(self, worker: WorkerRecord, ended_ref: Any) -> None:
        """Keep `worker` and follow it until `ended_ref` (its `run`, or `wait_stopped`) resolves."""
        self.records[worker.worker_id] = worker
        self._tasks.track(self._watch(worker, ended_ref))

    @staticmethod
    def _alive_nodes() -> list[placement.Node]:
        return [placement.Node(n["NodeID"], n.get("Labels") or {}, n["Resources"]) for n in ray.nodes() if n["Alive"]]

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
                self._release(worker)
                return
        worker.status = WorkerStatus.LOST
        worker.actor = None
        self._release(worker)
        self.top_up()

    @staticmethod
    def _release(worker: WorkerRecord) -> None:
        """The worker has ended: the bundle it still holds (no spare took it) goes back to the cluster."""
        bundles.release(worker.bundle)
        worker.bundle = None

    def lose(self, worker: WorkerRecord, cause: LostCause, reason: str) -> None:
        """Drop `worker` for `cause` (`reason` tells the details): it is fenced (its calls are refused
        from now on) and its process is ended."""
        if worker.status is WorkerStatus.LOST or self.over:
            return
        logger.warning("worker %d (pid %d) lost: %s", worker.worker_id, worker.pid, reason)
        self._telemetry.record(WorkerLost(worker.worker_id, worker.pid, worker.rank, worker.node_id, worker.generation,
                                          cause.value, reason, spare=worker.slot < 0))
        worker.status, worker.lost_reason = WorkerStatus.LOST, reason
        self._hand_over(worker)
        if worker.actor is not None:
            ray.kill(worker.actor, no_restart=True)  # `_watch` requests the replacement once it ended
        self._wake.set()

    def _hand_over(self, lost: WorkerRecord) -> None:
        """A warm spare takes the lost worker's place (placement.successor), and, holding nothing of
        its own, the bundle kept for it: the run is whole again as soon as the spare is ready."""
        if lost.slot < 0 or lost.leaving:
            return  # a spare, or a worker whose replacement was requested at its notice
        holds = self._spares_hold
        if not holds and lost.node_id not in {n.node_id for n in self._alive_nodes()}:
            return  # its node is gone, and the spares there with it
        spares = [(w.worker_id, w.node_id or w.planned_node, w.status is WorkerStatus.PARKED)
                  for w in self.records.values() if w.slot < 0 and w.status is not WorkerStatus.LOST and not w.leaving]
        chosen = placement.successor(lost.node_id or lost.planned_node, spares, anywhere=holds)
        if chosen is None:
            return
        spare = self.records[chosen]
        spare.slot = lost.slot
        if not holds:
            spare.bundle, lost.bundle = lost.bundle, None
        logger.info("warm spare %d takes the place of worker %d", spare.worker_id, lost.worker_id)

    def drop_silent(self, now: float) -> None:
        """Heartbeats prove the process: one silent for `heartbeat_timeout_s` is lost."""
        for w in self.records.values():
            silent = now - w.last_heartbeat
            if w.status in (WorkerStatus.TRAINING, WorkerStatus.PARKED) and silent > self._elastic.heartbeat_timeout_s:
                self.lose(w, LostCause.SILENT, f"no heartbeat for {silent:.1f}s")

    def drop_hung(self, members: list[WorkerRecord], now: float) -> bool:
        """The progress watchdog (`policy.stalled`): a member behind its peers with no report for
        `progress_timeout_s` is lost as hung; returns whether the generation stalled as a whole."""
        timeout = self._elastic.progress_timeout_s
        running = [m for m in members if m.status is WorkerStatus.TRAINING]
        stall = policy.stalled([policy.LastReport(m.worker_id, *m.last_report) for m in running], now, timeout)
        for worker_id in stall.hung:
            self.lose(self.records[worker_id], LostCause.HUNG,
                      f"no report for over progress_timeout_s={timeout}s while its peers were ahead")
        return stall.restart

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
            _answer(w, stop)
            if w.actor is not None and (now or w.status in (WorkerStatus.PENDING, WorkerStatus.LOST)):
                ray.kill(w.actor)
            if now:
                self._release(w)

    # == what happens to a worker's record ==========================================================
    def started(self, w: WorkerRecord, node_id: str, ip: str, pid: int) -> None:
        """The worker's process is up and told where it runs."""
        if w.status is WorkerStatus.PENDING:
            w.status = WorkerStatus.STARTING
        w.node_id, w.ip, w.pid, w.last_heartbeat = node_id, ip, pid, time.monotonic()
        self._wake.set()

    def parked(self, w: WorkerRecord, outcome: Outcome, store_port: int) -> asyncio.Future:
        """The worker left its generation (or is new) with `outcome`: it waits on the returned future
        for its next place."""
        w.status, w.outcome, w.store_port = WorkerStatus.PARKED, outcome, store_port
        w.holds = {(held.generation, held.index, name) for held in outcome.held for name in held.names}
        w.last_heartbeat = time.monotonic()
        w.waiting = asyncio.get_running_loop().create_future()
        self._wake.set()
        return w.waiting

    def ended_with(self, w: WorkerRecord, outcome: Outcome) -> None:
        """A member of the run's last generation left it after the run ended: what it raised belongs
        to the failure that ended the run."""
        w.outcome = outcome

    def release(self, w: WorkerRecord, place: Assignment | Stop) -> None:
        """Answer the parked worker's wait."""
        _answer(w, place)

    def rejoined(self, w: WorkerRecord, old_generation: int) -> None:
        """A lost worker that came back parks as a newcomer."""
        self._telemetry.record(FencedWorkerRejoined(w.worker_id, w.pid, old_generation))
        w.rank = -1

    def beat(self, w: WorkerRecord, facts: dict[str, float], in_generation: bool) -> None:
        """A heartbeat of a live worker, with what its process reports; `in_generation`: it is a
        member of the current generation, whose report under way counts as progress."""
        w.last_heartbeat = time.monotonic()
        w.facts = facts
        entered = int(facts.get("report_index", -1))  # a report still on its way, or held in the barrier
        if in_generation and entered > w.last_report[0]:
            w.last_report = (entered, w.last_heartbeat)

    def reported(self, w: WorkerRecord, index: int) -> None:
        w.last_report = (index, time.monotonic())

    def seat(self, chosen: list[WorkerRecord], places: Mapping[int, Assignment], index: int) -> None:
        """A new generation opened: `chosen` are its members from report `index` on, each at its place
        (a spare took its place at the loss it replaces); the other parked workers stand by (rank -1);
        a run at full size gets its warm spares."""
        for w in chosen:
            place = places[w.worker_id]
            w.status, w.generation, w.rank, w.outcome = WorkerStatus.TRAINING, place.generation, place.rank, None
            w.last_report = (index, time.monotonic())
            _answer(w, place)
        for w in self.with_status(WorkerStatus.PARKED):
            w.rank = -1
        self.top_up()

    def holds_copy(self, w: WorkerRecord, generation: int, index: int, names: list[str]) -> None:
        """The parked worker took a copy of files `names` of checkpoint `index` of `generation` into its memory."""
        w.holds.update((generation, index, name) for name in names)

    def noticed(self, w: WorkerRecord, machine_goes: bool) -> None:
        """The worker is under a preemption notice; `machine_goes`: its replacement goes elsewhere, and
        the warm spares there leave with the machine."""
        w.leaving = True
        if machine_goes:
            self.leaving_nodes.add(w.node_id)
            for spare in self.records.values():
                if spare.slot < 0 and spare.node_id == w.node_id and spare.status is not WorkerStatus.LOST:
                    spare.leaving = True
                    _answer(spare, Stop("its machine is about to be taken away"))

    def left(self, w: WorkerRecord, stop: Stop) -> None:
        """A worker under a preemption notice leaves the run (out of an ended generation)."""
        _answer(w, stop)
        self._telemetry.record(WorkerLeft(w.worker_id, w.pid, w.rank, w.node_id, w.generation,
                                          LostCause.PREEMPTED.value))
        w.status, w.lost_reason, w.rank = WorkerStatus.LOST, stop.reason, -1

    async def adopt(self, timeout_s: float) -> list[WorkerInfo]:
        """After a supervisor restart: records for the workers that describe themselves within
        `timeout_s`; returns the members of their newest generation, which go on in it."""
        found, self.next_id = await describe_workers(self._prefix, timeout_s)
        infos = [info for _, info in found]
        generation = max((i.generation for i in infos), default=-1)
        members = [i for i in infos if i.generation == generation and i.rank >= 0]
        now = time.monotonic()
        labels = {n.node_id: n.labels for n in self._alive_nodes()}
        free = list(range(self._scaling.max_workers))
        ordered = sorted(found, key=lambda found: found[1] not in members)  # members' slots first
        groups = bundles.adopt(self._prefix)
        held = bundles.assign({g: f.node_id for g, f in groups.items()}, [(i.bundle, i.node_id) for _, i in ordered])
        reserving = bool(self._need)  # workers run in bundles (`bundles.reserve`)
        for (handle, info), group in zip(ordered, held):
            member = info in members
            spare = reserving and group is None and not member  # a spare that took no bundle over
            slot = -1 if spare else placement.slot_of(labels.get(info.node_id, {}), self._scaling.label_selector, free)
            free = [s for s in free if s != slot]
            record = WorkerRecord(
                info.worker_id, handle, status=WorkerStatus.TRAINING if member else WorkerStatus.STARTING,
                node_id=info.node_id, ip=info.ip, pid=info.pid, last_heartbeat=now, last_report=(info.index, now),
                generation=info.generation if member else -1, rank=info.rank if member else -1, slot=slot,
                bundle=groups.pop(group).group if group is not None else None,
            )
            self.watch(record, handle.wait_stopped.remote())
        for left in groups.values():  # kept for a worker that is gone
            bundles.release(left.group)
        self._telemetry.record(SupervisorRestarted(sorted(i.worker_id for i in infos), generation,
                                                   {i.worker_id: i.rank for i in members},
                                                   max((i.index for i in members), default=0)))
        return members
