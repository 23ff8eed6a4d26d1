"""The controller: the run's control loop and the only writer of the run's state (its `RunState`,
its current generation, its failures).

Every event (a worker parked, lost, reported; a notice; a stop asked) wakes the loop, which asks
`policy` for a decision and carries it out: opening a generation as `opening.py` plans it, ending
one, resizing, failing. Workers' calls reach it through the actor's endpoints (actor.py); report
intake, heartbeats and preemption are their own modules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, ScalingConfig
from elastic_train.errors import StorageError
from elastic_train.events import (Failure, GenerationOpened, ResizeRequested,
                                  RunStarted, StateChanged, StopRequested, WorkerReady)
from elastic_train.protocol import Assignment, Exit, Outcome, PreemptionInfo, Stop
from elastic_train.run_folder.event_log import EventLog
from elastic_train.run_folder.summary import RunSummary
from elastic_train.run_spec import WorkerSpec
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.cadence import StoreCadence
from elastic_train.supervisor.checkpoints.commits import Commits
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.supervisor.ending import RunEnding
from elastic_train.supervisor.heartbeats import Heartbeats
from elastic_train.supervisor.membership import LostCause, WorkerRecord, WorkerStatus, assignments, raised, returned
from elastic_train.supervisor.opening import Openings
from elastic_train.supervisor.preemption.workers import LEFT, Preemption
from elastic_train.supervisor.reports import Reports
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunState, check_transition
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.metrics import RunMetrics
from elastic_train.supervisor.watch.telemetry import Telemetry

logger = logging.getLogger(__name__)


class Controller:
    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, failure: FailureConfig,
                 checkpointing: CheckpointConfig, prefix: str, adopting: bool):
        """`adopting`: Ray restarted the supervisor; the workers hold the run's state."""
        self._scaling = scaling
        self._failure = failure
        self._elastic: ElasticConfig = spec.elastic
        self._state = RunState.ADOPTING if adopting else RunState.SCHEDULING
        self._generation = -1
        self._opened = False  # a generation opened under this supervisor
        self._world_size = 0
        self._entered = self._started = time.monotonic()
        self._expected_initial = 0
        self._failures = 0
        self._counted: set[int] = set()  # generations whose user error was counted
        self._error: str | None = None
        self._worker_failures: dict[int, BaseException] = {}
        self._preemption: PreemptionInfo | None = None  # what the run was preempted with, if that failed it
        self.stopping: str | None = None  # why `stop_run` was asked
        self.aborted = False  # `fail_now(abort=True)`
        self.adopted = asyncio.Event()  # worker calls wait for it: none is served before adoption
        self.wake = asyncio.Event()
        self.closed = False  # the run ended and everything was fed
        self.log = EventLog(spec.storage, go_on=adopting)  # a restarted supervisor appends to its predecessor's
        self.exported = RunMetrics(spec.run.name)  # for Prometheus, through Ray's metrics agent
        self.exported.state(self._state)
        self.telemetry = Telemetry([self.log, self.exported], self._started)
        self.tasks = Tasks()
        self.ledger = CheckpointLedger(self._elastic.checkpoints_in_memory)
        self.cadence = StoreCadence(checkpointing, time.monotonic())
        self.roster = Roster(spec, scaling, prefix, self.telemetry, self.tasks, self.wake)
        self.commits = Commits(spec.storage, checkpointing, self.ledger, self, self.telemetry, self.tasks)
        self.reports = Reports(self, self._elastic, self.roster, self.ledger, self.commits, self.cadence,
                               self.telemetry, self.exported)
        self.heartbeats = Heartbeats(self, self._elastic, self.roster, self.telemetry, self.adopted)
        self.ending = RunEnding(self._elastic, self.roster, self.ledger, self.commits, self.tasks, self.telemetry)
        self.openings = Openings(scaling, self._elastic, self.ledger, self.roster, self.commits)
        self.preemption = Preemption(self, self._elastic, failure, self.roster, self.ledger, self.reports,
                                     self.telemetry, self.tasks, self.wake)

    # == what the rest of the supervisor reads (state.RunView) =====================================
    @property
    def state(self) -> RunState:
        return self._state

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def under_way(self) -> bool:
        """Is a run under way, that a worker starting now would join? A generation opened under this
        supervisor, or it adopts the workers of one."""
        return self._opened or self._state is RunState.ADOPTING

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def flush_chosen(self) -> bool:
        return self.ending.decided.is_set()

    def is_member(self, w: WorkerRecord) -> bool:
        return w.is_member(self._generation)

    def over(self, generation: int) -> bool:
        """Has `generation` ended (its members are to leave it)?"""
        return generation != self._generation or not self._state.training

    def members(self) -> list[WorkerRecord]:
        return self.roster.members(self._generation)

    def _going_on(self) -> bool:
        return not self._state.terminal

    # == the loop ====================================================================================
    async def run(self) -> RunSummary:
        self.roster.supervisor = ray.get_runtime_context().current_actor
        await self.heartbeats.open()
        adopting = self._state is RunState.ADOPTING
        try:
            # A restarted supervisor leaves uncommitted folders alone: adopted workers may still commit them.
            stored = await asyncio.get_running_loop().run_in_executor(None, self.commits.recover, not adopting)
            self._generation = max(self._generation, stored)
        except StorageError as exc:
            self.fail(str(exc))
        self._expected_initial = min(self._scaling.max_workers, self.roster.placeable_now())
        if adopting and not self._state.terminal:
            await self._adopt_workers()
        else:
            self.telemetry.record(RunStarted(self._expected_initial))
        self.adopted.set()
        periodic = [Tasks.every(self._elastic.event_log_interval_s, self.log.write, self._going_on),
                    Tasks.every(self._elastic.metrics_interval_s, self._sample_metrics, self._going_on)]
        if self._elastic.watch_ray_drains:
            periodic.append(Tasks.every(self._elastic.preemption_poll_interval_s, self._check_ray_drains, self._going_on))
        self.roster.top_up()
        while not self._state.terminal:
            try:
                await asyncio.wait_for(self.wake.wait(), self._elastic.control_tick_s)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()
            self._step(time.monotonic())
        errored = self._state is RunState.ERRORED and not self.aborted
        await self.ending.carry_out(self._state, self._end_generation() if errored else [], self.aborted)
        self.heartbeats.close()
        for task in periodic:
            task.cancel()
        await self.log.write()
        if self._worker_failures and self._state is RunState.ERRORED:
            self._worker_failures = raised(self.members()) or self._worker_failures  # with the ranks that parked since
        self.reports.feed.settle_all()
        self.closed = True
        self.telemetry.news()
        return RunSummary(self._state, self._error, self.reports.metrics, self.reports.history, self.commits.committed,
                          self.log.entries, self._worker_failures, self._preemption, self.stopping,
                          returned(self.members()) if self._state is RunState.FINISHED else None)

    async def _adopt_workers(self) -> None:
        """After a restart: adopt the workers that describe themselves. The members of their newest
        generation go on where they are (their in-flight calls are retried here); if a rank of it is
        missing, the generation is re-formed from what the members hold in memory."""
        members = await self.roster.adopt(self._elastic.supervisor_adoption_timeout_s)
        if not members:
            self._transition(RunState.SCHEDULING, reason="supervisor restarted before the first generation")
            return
        generation, self._world_size = members[0].generation, members[0].world_size
        self._generation = generation
        self.reports.adopt(generation, self._world_size, members)
        self._transition(RunState.RUNNING, reason="supervisor restarted", generation=generation)
        missing = set(range(self._world_size)) - {m.rank for m in members}
        if missing:
            self.restart(f"supervisor restarted; rank(s) {sorted(missing)} of generation {generation} not found")

    def _step(self, now: float) -> None:
        self.roster.drop_silent(now)
        self.reports.settle_hopeless()
        if self._state.training and self.roster.drop_hung(self.members(), now):  # heartbeats prove the process only
            self.restart(f"no member reported within progress_timeout_s={self._elastic.progress_timeout_s}s")
        if self.stopping is not None:
            self._step_stopping(now)
        elif self._state is RunState.SCHEDULING:
            parked = self.roster.ready()
            self._carry_out(policy.scheduling(
                parked=len(parked), starting=len(self.roster.with_status(WorkerStatus.STARTING)),
                first=self._generation < 0, expected_initial=self._expected_initial, waited_s=now - self._entered,
                scaling=self._scaling, elastic=self._elastic), parked)
        elif self._state.training:
            self.roster.top_up()  # a warm spare once the run is old enough (ElasticConfig.warm_spares_after_s)
            standby = [w for w in self.roster.standby(self._generation) if not w.leaving]
            staying = [w for w in self.members() if not w.leaving]
            self._carry_out(policy.running(
                self._views(), resizing=self._state is RunState.RESIZING, standby=len(standby), scaling=self._scaling,
                failure=self._failure, error_counted=self._generation in self._counted,
                in_place=self.openings.going_on(staying, self._generation)[0] is not None),
                [w for w in self.members() if not w.leaving] + standby)
        elif self._state is RunState.RESTARTING:
            ready = self.roster.ready()
            decision = policy.restarting(
                self._views(), parked=len(ready), waited_s=now - self._entered,
                drain_timeout_s=self._elastic.drain_timeout_s, scaling=self._scaling,
                error_counted=self._generation in self._counted, in_place=self.openings.going_on(ready, self._generation)[0] is not None)
            self._drop(decision.dropped, decision.reason)
            self._carry_out(decision, self.roster.ready())

    def _step_stopping(self, now: float) -> None:
        """`stop_run` was asked: members leave their generation, then the run finishes as usual (the
        newest checkpoint held in memory is stored, torn folders are swept)."""
        if self._state.training:
            self.restart(f"stop requested: {self.stopping}")
            return
        decision = policy.stopping(self._views() if self._state is RunState.RESTARTING else [],
                                   waited_s=now - self._entered, drain_timeout_s=self._elastic.drain_timeout_s)
        self._drop(decision.dropped, decision.reason)
        self._carry_out(decision, [])

    def _drop(self, worker_ids: list[int], reason: str) -> None:
        for worker_id in worker_ids:
            self.roster.lose(self.roster.records[worker_id], LostCause.FENCED, reason)

    def _carry_out(self, decision: policy.Decision, candidates: list[WorkerRecord]) -> None:
        """The side effects of a decision of `policy`."""
        if decision.failure is not None:
            self._counted.add(self._generation)
            self._count_failure(decision.failure, raised(self.members()))
            if self._state.terminal:
                return
        do = decision.do
        if do in (policy.Do.OPEN, policy.Do.SCHEDULE) and not self.preemption.released():
            return  # leaving workers hand their checkpoint parts over first
        if do is policy.Do.FINISH:
            self._transition(RunState.FINISHED)
        elif do is policy.Do.RESTART:
            self.restart(decision.reason)
        elif do is policy.Do.RESIZE:
            self.reports.unwind_after(self.reports.latest + 1, self.members(), self._generation, grow=True)
            self.telemetry.record(ResizeRequested(self.reports.resize_at, decision.reason))
            self._transition(RunState.RESIZING)
        elif do is policy.Do.OPEN:
            self._open_generation(candidates, decision.reason)
        elif do is policy.Do.SCHEDULE and self._state is not RunState.SCHEDULING:
            self._transition(RunState.SCHEDULING, reason=decision.reason)
        elif do is policy.Do.FAIL:
            self.fail(decision.reason)

    def _views(self) -> list[policy.Member]:
        return [policy.Member.of(m) for m in self.members()]

    # == transitions ===================================================================================
    def _transition(self, target: RunState, **details: Any) -> None:
        check_transition(self._state, target)
        logger.info("run state %s -> %s %s", self._state.value, target.value, details or "")
        self.telemetry.record(StateChanged(self._state.value, target.value, **details))
        self._state = target
        self._entered = time.monotonic()
        self.roster.over = target.terminal
        if target is not RunState.RESIZING:
            self.reports.release()

    def restart(self, reason: str) -> None:
        """Leave the current generation: abort survivors' groups, probe members that did not exit."""
        self._transition(RunState.RESTARTING, reason=reason)
        for m in self._end_generation():
            self.tasks.track(self.roster.probe(m))

    def _end_generation(self) -> list[WorkerRecord]:
        """Tell the members still in the generation to leave it (their collectives fail, the loop
        unwinds); returns them."""
        staying = [m for m in self.members() if m.status is WorkerStatus.TRAINING]
        for m in staying:
            m.actor.end_generation.remote(self._generation)
        return staying

    def _count_failure(self, detail: str, by_rank: dict[int, BaseException]) -> None:
        self._failures += 1
        self.telemetry.record(Failure(self._failures, self._failure.max_failures, detail[-2000:], by_rank))
        if policy.out_of_failures(self._failures, self._failure):
            self.fail(detail, by_rank)

    def fail(self, error: str, by_rank: dict[int, BaseException] | None = None) -> None:
        """The run failed: `by_rank` holds what the user's code raised by rank, when that failed it."""
        self._error = error
        self._worker_failures = by_rank or {}
        self._transition(RunState.ERRORED)

    def _open_generation(self, candidates: list[WorkerRecord], reason: str = "") -> None:
        self.reports.close(self._generation)  # first: the plan weighs the newest state its reports made
        opening = self.openings.plan(candidates, self._generation)
        chosen, at = opening.chosen, opening.at
        previous_ranks = tuple(w.rank for w in chosen) if at is not None else None
        resume = self.openings.resume(opening, self._generation)
        self._generation += 1
        self._opened = True
        self._world_size = len(chosen)
        if at is None and resume is not None:
            self.ledger.restoring(resume)
        start = resume.index if resume else 0
        self.ledger.rewind(start)
        self.reports.open(start)
        self.cadence.forget_in_flight()
        plan = opening.plan
        places = assignments(plan, opening.candidates, self._generation, resume, self._scaling.max_workers,
                             previous_ranks)
        self.roster.seat(chosen, places, start)
        self.telemetry.record(GenerationOpened(
            self._generation, len(chosen),
            {w.worker_id: {"rank": plan.placements[w.worker_id].rank, "pid": w.pid, "node": w.node_id} for w in chosen},
            resume_index=resume.index if resume else None,
            resume_from=opening.resumed_from(resume), reentered_because=opening.why))
        self._transition(RunState.RUNNING, generation=self._generation, world_size=len(chosen), reason=reason or None)

    # == what workers and the driver ask of the run ====================================================
    async def park(self, w: WorkerRecord, outcome: Outcome, store_port: int) -> Assignment | Stop:
        """A worker left its generation (or is new) and waits for its next place."""
        if self._state.terminal:
            if self.is_member(w) and outcome.generation == self._generation:
                self.roster.ended_with(w, outcome)  # what it raised belongs to the failure that ended the run
                self.telemetry.news()  # the run's end waits for it
            return await self.ending.stop()
        if w.status is WorkerStatus.LOST:
            if w.actor is None:
                return Stop("this worker was declared dead")
            self.roster.rejoined(w, outcome.generation)
        if w.leaving and not self.is_member(w):
            return Stop(LEFT)  # a standby: nothing to hand over
        if outcome.unagreed is not None and self.is_member(w) and outcome.generation == self._generation:
            self.reports.unagreed(w, outcome.unagreed)
        self.ledger.note_held(w.worker_id, outcome.held)
        if outcome.exit is Exit.JOINED:
            self.telemetry.record(WorkerReady(w.worker_id, w.pid, w.node_id))
        return await self.roster.parked(w, outcome, store_port)

    def notice(self, w: WorkerRecord, source: str, seconds_left: float | None) -> None:
        """Re-form the group without a worker under a notice while it still serves its checkpoint: at the
        next report, or the one after `get_preemption_info()` tells the loop (which saves one there)."""
        if w.leaving or w.status is WorkerStatus.LOST or self._state.terminal:
            return
        preempted = self.preemption.note(w, source, seconds_left)
        if self._state is RunState.RUNNING and self.is_member(w):
            if preempted is not None:
                self._preemption = preempted
                self.fail(f"preempted {self.preemption.notices.count} times, over FailureConfig."
                          f"max_preemption_failures={self._failure.max_preemption_failures}")
                return
            asks = self._generation in self.preemption.notices.asked_in
            self.reports.unwind_after(policy.resize_point(self.reports.latest, asks), self.members(), self._generation)
            self._transition(RunState.RESIZING, reason=f"worker {w.worker_id} preempted",
                             at="the report after get_preemption_info()" if asks else "the next report")
        elif not self.is_member(w):
            self.roster.release(w, Stop(LEFT))  # a standby: nothing to hand over
        self.roster.top_up()
        self.wake.set()

    def copy_corrupt(self, w: WorkerRecord | None, generation: int, index: int, holder: int, problem: str) -> None:
        """A member was served a corrupt copy of checkpoint `index`: the next generation resumes elsewhere."""
        if w is not None and self.is_member(w) and not self.over(generation):
            self.restart(f"checkpoint {index} served from worker {holder}'s memory is corrupt: {problem}")

    def stop(self, reason: str) -> None:
        """End the run cleanly, as if its loop had returned."""
        if self._state.terminal or self.stopping is not None:
            return
        self.stopping = reason
        self.telemetry.record(StopRequested(reason))
        self.wake.set()

    def settle(self, generation: int, index: int, committed: CommittedCheckpoint | None) -> None:
        self.reports.settle(generation, index, committed)

    def fail_now(self, message: str, abort: bool = False) -> None:
        """The run fails at once: storage refused for good, or `abort` (Ctrl-C in the driver, as Ray
        Train aborts: its workers are ended at once, nothing more is stored)."""
        if not self._state.terminal:
            self.aborted = abort
            self.fail(message)
            self.wake.set()

    def live_workers(self) -> set[int]:
        return self.roster.live_ids()

    # == work at intervals ===============================================================================
    async def _sample_metrics(self) -> None:
        self.exported.sample(self.members(), self.reports.pace.stragglers, self.reports.pace.growing,
                             time.monotonic())

    async def _check_ray_drains(self) -> None:
        """Nodes that Ray drains are preemption notices for the workers on them."""
        for w, seconds_left in await self.preemption.drained():
            self.notice(w, "ray_drain", seconds_left)

