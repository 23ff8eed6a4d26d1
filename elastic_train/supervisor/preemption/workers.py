"""Workers under a preemption notice, on the supervisor: what `get_preemption_info()` answers (every
rank alike), and the hand-over as they leave — once their generation ended, what only they hold of
the resume checkpoint goes to a staying worker's memory (or is stored), then they stop and free their
slot for the replacement requested when the notice came. Also Ray's draining nodes, which are
notices too (`ray drain-node`, KubeRay, the autoscaler)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from elastic_train.config import ElasticConfig, FailureConfig
from elastic_train.events import CheckpointHandedOver, PreemptionNotice, ResizeRequested
from elastic_train.protocol import PreemptionInfo, ResumePlan, Stop
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus
from elastic_train.supervisor.preemption import notices
from elastic_train.supervisor.reports import Reports
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunState, RunView
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry

logger = logging.getLogger(__name__)

LEFT = "left under a preemption notice"


class Preemption:
    def __init__(self, run: RunView, elastic: ElasticConfig, failure: FailureConfig, roster: Roster,
                 ledger: CheckpointLedger, reports: Reports, telemetry: Telemetry, tasks: Tasks, wake: asyncio.Event):
        self._run = run
        self._elastic = elastic
        self._roster = roster
        self._ledger = ledger
        self._reports = reports
        self._telemetry = telemetry
        self._tasks = tasks
        self._wake = wake
        self.notices = notices.Notices(failure.max_preemption_failures)
        self._handover: asyncio.Future | None = None  # leaving workers handing their parts over

    def note(self, w: WorkerRecord, source: str, seconds_left: float | None) -> PreemptionInfo | None:
        """`w` is under a notice from `source`; returns what the run was preempted with when that spends
        the preemption budget (`FailureConfig.max_preemption_failures`)."""
        self._roster.noticed(w, machine_goes=source != "sigterm")
        self.notices.noted(w.worker_id, seconds_left)
        self._telemetry.record(PreemptionNotice(w.worker_id, w.pid, w.rank, w.node_id, source, seconds_left))
        return notices.preemption_info(self.leaving()) if self.notices.preempted() else None

    def leaving(self) -> list[notices.Leaving]:
        """The members of the current generation under a notice."""
        return [notices.Leaving(w.rank, w.node_id, self.notices.deadlines.get(w.worker_id))
                for w in self._run.members() if w.leaving]

    async def info(self, w: WorkerRecord | None, generation: int, call: int, index: int) -> tuple[bool, Any]:
        """`get_preemption_info()` call number `call` of a member, made after report `index`: every
        rank gets the same answer. Once the loop saw a notice, it re-forms after its next report."""
        self.notices.asked_in.add(generation)
        accepted, info = await self._reports.agree(
            w, generation, index, ("preemption_info", generation, call), None,
            lambda _: notices.preemption_info(self.leaving()), self._elastic.preemption_info_timeout_s,
            f"get_preemption_info() call {call}", "preemption_info_timeout_s")
        if info is not None and self._run.state is RunState.RESIZING and self._reports.resize_at is None:
            self._reports.unwind_after(index + 1, self._run.members(), self._run.generation)
            self._telemetry.record(ResizeRequested(self._reports.resize_at, "the loop saw the preemption notice"))
        return accepted, info

    def released(self) -> bool:
        """True once no worker under a notice waits to leave (a new generation opens only then); else
        starts their hand-over, once no member is in the ended generation any more."""
        leaving = [w for w in self._roster.with_status(WorkerStatus.PARKED) if w.leaving]
        if not leaving:
            return True
        if self._handover is None and not any(m.status is WorkerStatus.TRAINING for m in self._run.members()):
            self._handover = self._tasks.track(self._hand_over(leaving))
        return False

    async def _hand_over(self, leaving: list[WorkerRecord]) -> None:
        leaving_ids = {w.worker_id for w in leaving}
        staying = [w for w in self._run.members() if w.status is WorkerStatus.PARKED and w.worker_id not in leaving_ids]
        holds = self._roster.holds()
        whole = self._ledger.resume_plan({w.worker_id for w in leaving + staying}, holds)
        kept = self._ledger.resume_plan({w.worker_id for w in staying}, holds)
        do = policy.hand_over(whole, kept, anyone_stays=bool(staying))
        flush = whole if do is policy.HandOver.STORE else None
        try:
            if do is policy.HandOver.MOVE:
                target = min(staying, key=lambda w: w.rank)
                await asyncio.gather(*[self._hand_over_part(self._roster.records[wid], target, whole, names)
                                       for wid, names in whole.holders.items() if wid in leaving_ids])
        finally:
            for w in leaving:
                self._roster.left(w, Stop(LEFT, flush=flush))
            self._handover = None
            self._wake.set()

    async def _hand_over_part(self, source: WorkerRecord, target: WorkerRecord, plan: ResumePlan,
                              names: list[str]) -> None:
        try:
            await asyncio.wait_for(source.actor.hand_over.remote(plan.generation, plan.index, names, target.actor),
                                   self._elastic.drain_timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("worker %d could not hand checkpoint %d over: %r", source.worker_id, plan.index, exc)
            return
        self._ledger.record_replica(plan.generation, plan.index, target.worker_id, names)
        self._roster.holds_copy(target, plan.generation, plan.index, names)
        self._telemetry.record(CheckpointHandedOver(source.worker_id, target.worker_id, plan.index, names))

    async def drained(self) -> list[tuple[WorkerRecord, float | None]]:
        """The workers on nodes Ray drains and not yet under a notice, with their seconds left (None:
        no deadline given); none when Ray's state could not be read (tried again at the next poll)."""
        try:
            draining = await asyncio.get_running_loop().run_in_executor(
                None, ray._private.state.state.get_draining_nodes)
        except Exception as exc:  # noqa: BLE001 - a GCS hiccup: try again at the next poll
            logger.warning("could not read Ray's draining nodes: %r", exc)
            return []
        return [(w, max(0.0, draining[w.node_id] / 1000 - time.time()) if draining[w.node_id] else None)
                for w in list(self._roster.records.values())
                if w.node_id in draining and not w.leaving and w.status is not WorkerStatus.LOST]
