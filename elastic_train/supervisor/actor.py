"""`Supervisor`: the Ray actor that owns membership and drives the run's state machine.

Workers talk to it (heartbeat, report, park); Ray tells it when a worker actor dies. Every such
event updates the records and wakes the control loop, which is the only place where the run's
state changes (see `state.py`). Side effects of a transition (spawning replacement workers,
aborting survivors' groups, committing checkpoints) are started from there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import warnings
from typing import Any

import ray

from elastic_train.config import CheckpointConfig, ElasticConfig, FailureConfig, ScalingConfig
from elastic_train.protocol import (
    Assignment,
    Beat,
    Exit,
    Feed,
    HeartbeatChannel,
    HeartbeatReply,
    Outcome,
    Pace,
    PreemptionInfo,
    Report,
    ReportRecord,
    ReportReply,
    ResumePlan,
    Stop,
)
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import StorageError
from elastic_train.supervisor.agreement import Agreements
from elastic_train.supervisor.adoption import describe_workers, worker_prefix
from elastic_train.supervisor.cadence import PersistCadence
from elastic_train.supervisor.commits import Commits
from elastic_train.run_folder.events import EventLog
from elastic_train.run_folder.summary import RunSummary
from elastic_train.supervisor.feed import ReportFeed
from elastic_train.supervisor.heartbeats import HeartbeatEndpoint, open_endpoint
from elastic_train.supervisor import notices
from elastic_train.supervisor.ledger import CheckpointLedger, ReportEntry
from elastic_train.supervisor.pace import PaceWatch, peer_medians
from elastic_train.supervisor.metrics import RunMetrics
from elastic_train.supervisor.membership import LostCause, WorkerRecord, WorkerStatus, plan_generation
from elastic_train.supervisor import policy
from elastic_train.supervisor.state import RunState, check_transition
from elastic_train.supervisor.workers import WorkerPool, release
from elastic_train.worker.actor import WorkerSpec

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        spec: WorkerSpec,
        scaling: ScalingConfig,
        failure: FailureConfig,
        checkpointing: CheckpointConfig,
    ):
        self._spec = spec
        self._scaling = scaling
        self._failure = failure
        self._checkpointing = checkpointing
        self._elastic: ElasticConfig = spec.elastic
        self._storage: RunStorage = spec.storage
        context = ray.get_runtime_context()
        self._worker_prefix = worker_prefix(context.get_actor_id())
        self._incarnation = uuid.uuid4().hex  # tells the driver's feed a restarted supervisor from its predecessor
        # Ray restarted this actor after it died: the workers hold the run's state; adopt them.
        with warnings.catch_warnings():  # Ray's own property calls its deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = context.was_current_actor_reconstructed
        self._state = RunState.ADOPTING if restarted else RunState.SCHEDULING
        self._adopted = asyncio.Event()  # worker calls wait for it: none is served before adoption
        self._entered = time.monotonic()
        self._started = time.monotonic()
        self._generation = -1
        self._world_size = 0
        self._tasks: set[asyncio.Future] = set()
        self._expected_initial = 0
        self._resize_at: int | None = None
        self._barriers: dict[int, asyncio.Event] = {}  # report index -> set when every member made it
        self._handover: asyncio.Future | None = None  # leaving workers handing their checkpoint parts over
        self._max_index = 0
        self._failures = 0
        self._counted: set[int] = set()  # generations whose user error was counted
        self._error: str | None = None
        self._ledger = CheckpointLedger(self._elastic.checkpoints_in_memory)
        self._cadence = PersistCadence(checkpointing, time.monotonic())
        self._wake = asyncio.Event()
        self._exported = RunMetrics(spec.run.name)  # for Prometheus, through Ray's metrics agent
        self._exported.state(self._state)
        self._pool = WorkerPool(spec, scaling, self._worker_prefix, event=self._event, changed=self._wake.set,
                                track=self._track, over=lambda: self._state.terminal)
        self._commits = Commits(self._storage, checkpointing, self._ledger, settled=self._settled, event=self._event,
                                fail=self._storage_failed, live_workers=self._pool.live_ids, track=self._track)
        self._feed = ReportFeed()
        self._fed = asyncio.Event()  # set when a report settles or an event is recorded: `feed` waits on it
        self._closed = False  # the run ended and everything was fed
        self._stopping: str | None = None  # why `stop_run` was asked
        self._worker_failures: dict[int, BaseException] = {}
        self._preemption: PreemptionInfo | None = None
        self._notices = notices.Notices(failure.max_preemption_failures)
        self._agreements = Agreements()  # get_preemption_info() and collective calls waiting for their peers
        self._paces: dict[tuple[int, int], dict[int, Pace]] = {}  # (generation, index) -> worker -> its pace
        self._pace = PaceWatch(self._elastic.straggler_factor, self._elastic.straggler_reports,
                               self._elastic.straggler_min_excess_s, self._elastic.memory_growth_reports,
                               self._elastic.memory_growth_min_mb * 2**20)
        self._final_flush: ResumePlan | None = None  # what the workers store before they stop
        self._flush_chosen = asyncio.Event()  # `_final_flush` is decided: no report is recorded after it
        self._metrics: dict[str, Any] = {}
        self._history: list[dict[str, Any]] = []
        self._log = EventLog(self._storage, go_on=restarted)  # a restarted supervisor appends to its predecessor's
        self._events = self._log.entries
        self._beats: HeartbeatEndpoint | None = None  # heartbeats as UDP datagrams (supervisor/heartbeats.py)
        self._channel: HeartbeatChannel | None = None  # where workers send them; None: through Ray calls
        self._heartbeats = {"udp": 0, "ray": 0}  # heartbeats received, by the path they took (`status`)

    # == the control loop ==========================================================================
    async def run(self) -> RunSummary:
        self._pool.supervisor = ray.get_runtime_context().current_actor
        await self._open_heartbeats()
        adopting = self._state is RunState.ADOPTING
        try:
            # A restarted supervisor leaves uncommitted folders alone: adopted workers may still commit them.
            stored = await asyncio.get_running_loop().run_in_executor(None, self._commits.recover, not adopting)
            self._generation = max(self._generation, stored)
        except StorageError as exc:
            self._fail(str(exc))
        self._expected_initial = min(self._scaling.max_workers, self._pool.placeable_now())
        if adopting and not self._state.terminal:
            await self._adopt_workers()
        else:
            self._event("run_started", expected_workers=self._expected_initial)
        self._adopted.set()
        # Not tracked: shut-down does not wait for their sleeps.
        periodic = [asyncio.ensure_future(self._every(self._elastic.event_log_interval_s, self._write_events)),
                    asyncio.ensure_future(self._every(self._elastic.metrics_interval_s, self._sample_metrics))]
        if self._elastic.watch_ray_drains:
            periodic.append(asyncio.ensure_future(
                self._every(self._elastic.preemption_poll_interval_s, self._check_ray_drains)))
        self._pool.top_up()
        while not self._state.terminal:
            try:
                await asyncio.wait_for(self._wake.wait(), self._elastic.control_tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self._step(time.monotonic())
        await self._shut_down()
        if self._beats is not None:
            self._beats.close()
        for task in periodic:
            task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self._log.flush)
        if self._worker_failures and self._state is RunState.ERRORED:
            self._worker_failures = self._raised() or self._worker_failures  # with the ranks that parked since
        self._feed.settle_all()
        self._closed = True
        self._fed.set()
        return RunSummary(self._state, self._error, self._metrics, self._history, self._commits.committed,
                          self._events, self._worker_failures, self._preemption, self._stopping, self._returned())

    async def _open_heartbeats(self) -> None:
        """Listen for heartbeat datagrams (unless `heartbeat_udp` is off): the channel goes with every
        reply to a heartbeat call."""
        if self._elastic.heartbeat_udp:
            self._beats, self._channel = await open_endpoint(
                ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), self._beat)

    async def _adopt_workers(self) -> None:
        """After a restart: adopt the workers that describe themselves. The members of their newest
        generation go on where they are (their in-flight calls are retried here); if a rank of it is
        missing, the generation is re-formed from what the members hold in memory."""
        found, self._pool.next_id = await describe_workers(self._worker_prefix,
                                                             self._elastic.supervisor_adoption_timeout_s)
        infos = [info for _, info in found]
        generation = max((i.generation for i in infos), default=-1)
        members = [i for i in infos if i.generation == generation and i.rank >= 0]
        now = time.monotonic()
        for handle, info in found:
            member = info in members
            record = WorkerRecord(
                info.worker_id, handle, status=WorkerStatus.MEMBER if member else WorkerStatus.STARTING,
                node_id=info.node_id, ip=info.ip, pid=info.pid, last_heartbeat=now, last_report=(info.index, now),
                generation=info.generation if member else -1, rank=info.rank if member else -1,
            )
            self._pool.watch(record, handle.wait_stopped.remote())
        self._event("supervisor_restarted", adopted=sorted(i.worker_id for i in infos), generation=generation,
                    members={i.worker_id: i.rank for i in members}, index=max((i.index for i in members), default=0))
        if not members:
            self._transition(RunState.SCHEDULING, reason="supervisor restarted before the first generation")
            return
        self._generation, self._world_size = generation, members[0].world_size
        self._ledger.adopt(generation, self._world_size, members)
        self._max_index = max(m.index for m in members)
        self._event("generation", generation=generation, world_size=self._world_size, adopted=True,
                    members={m.worker_id: {"rank": m.rank, "pid": m.pid, "node": m.node_id} for m in members})
        self._transition(RunState.RUNNING, reason="supervisor restarted", generation=generation)
        missing = set(range(self._world_size)) - {m.rank for m in members}
        if missing:
            self._restart(f"supervisor restarted; rank(s) {sorted(missing)} of generation {generation} not found")

    def _step(self, now: float) -> None:
        self._pool.drop_silent(now)
        self._settle_hopeless()
        if self._state in (RunState.RUNNING, RunState.RESIZING):
            self._drop_hung_workers(now)
        if self._stopping is not None:
            self._step_stopping(now)
        elif self._state is RunState.SCHEDULING:
            self._step_scheduling(now)
        elif self._state in (RunState.RUNNING, RunState.RESIZING):
            self._step_running()
        elif self._state is RunState.RESTARTING:
            self._step_restarting(now)

    def _step_scheduling(self, now: float) -> None:
        parked = self._ready()
        decision = policy.scheduling(
            parked=len(parked), starting=len(self._pool.with_status(WorkerStatus.STARTING)), first=self._generation < 0,
            expected_initial=self._expected_initial, waited_s=now - self._entered, scaling=self._scaling,
            elastic=self._elastic)
        self._carry_out(decision, parked)

    def _step_running(self) -> None:
        decision = policy.running(
            self._member_views(), resizing=self._state is RunState.RESIZING,
            standby=sum(not w.leaving for w in self._standby()), scaling=self._scaling, failure=self._failure,
            error_counted=self._generation in self._counted)
        self._carry_out(decision, [w for w in self._members() + self._standby() if not w.leaving])

    def _step_restarting(self, now: float) -> None:
        decision = policy.restarting(
            self._member_views(), parked=len(self._ready()), waited_s=now - self._entered,
            drain_timeout_s=self._elastic.drain_timeout_s, scaling=self._scaling,
            error_counted=self._generation in self._counted)
        for worker_id in decision.dropped:
            self._pool.lose(self._pool.records[worker_id], LostCause.FENCED, decision.reason)
        self._carry_out(decision, self._ready())

    def _step_stopping(self, now: float) -> None:
        """`stop_run` was asked: members leave their generation, then the run finishes as usual (the
        newest checkpoint held in memory is stored, torn folders are swept)."""
        if self._state in (RunState.RUNNING, RunState.RESIZING):
            self._restart(f"stop requested: {self._stopping}")
            return
        decision = policy.stopping(self._member_views() if self._state is RunState.RESTARTING else [],
                                   waited_s=now - self._entered, drain_timeout_s=self._elastic.drain_timeout_s)
        for worker_id in decision.dropped:
            self._pool.lose(self._pool.records[worker_id], LostCause.FENCED, decision.reason)
        self._carry_out(decision, [])

    def _carry_out(self, decision: policy.Decision, candidates: list[WorkerRecord]) -> None:
        """The side effects of a decision of `policy`."""
        if decision.failure is not None:
            self._counted.add(self._generation)
            self._count_failure(decision.failure, self._raised())
            if self._state.terminal:
                return
        do = decision.do
        if do in (policy.Do.OPEN, policy.Do.SCHEDULE) and not self._leaving_released():
            return  # leaving workers hand their checkpoint parts over first
        if do is policy.Do.FINISH:
            self._transition(RunState.FINISHED)
        elif do is policy.Do.RESTART:
            self._restart(decision.reason)
        elif do is policy.Do.RESIZE:
            self._resize_after(self._max_index + 1)
            self._event("resize_requested", at_report=self._resize_at, reason=decision.reason)
            self._transition(RunState.RESIZING)
        elif do is policy.Do.OPEN:
            self._open_generation(candidates)
        elif do is policy.Do.SCHEDULE and self._state is not RunState.SCHEDULING:
            self._transition(RunState.SCHEDULING, reason=decision.reason)
        elif do is policy.Do.FAIL:
            self._fail(decision.reason)

    def _resize_after(self, index: int | None) -> None:
        """Members leave the loop at report `index` (or the first after it), for the group to re-form;
        None: not yet (the loop asks `get_preemption_info()` first). Reports without a checkpoint do
        not wait for a reply, so each member is told."""
        self._resize_at = index
        if index is not None:
            for m in self._members():
                m.actor.unwind_at.remote(self._generation, index)

    def _raised(self) -> dict[int, BaseException]:
        """What the user's code raised on each rank of the current generation (a rank that raised
        after the generation ended, its peers' error having ended it, is one too)."""
        return {m.rank: m.outcome.raised() for m in self._members()
                if m.outcome is not None and m.outcome.error is not None}

    def _returned(self) -> bytes | None:
        """What rank 0's loop returned, if the run finished with it."""
        if self._state is not RunState.FINISHED:
            return None
        return next((m.outcome.returned for m in self._members()
                     if m.rank == 0 and m.outcome is not None and m.outcome.exit is Exit.FINISHED), None)

    def _member_views(self) -> list[policy.Member]:
        return [policy.Member(m.worker_id, m.rank, exit=m.exited, lost=m.status is WorkerStatus.LOST,
                              leaving=m.leaving,
                              detail=m.lost_reason if m.status is WorkerStatus.LOST else
                              (m.outcome.detail if m.outcome else ""))
                for m in self._members()]

    def _ready(self) -> list[WorkerRecord]:
        """Workers parked and ready for the next generation (none under a preemption notice)."""
        return [w for w in self._pool.with_status(WorkerStatus.PARKED) if not w.leaving]

    # == transitions and their side effects ========================================================
    def _transition(self, target: RunState, **details: Any) -> None:
        check_transition(self._state, target)
        logger.info("run state %s -> %s %s", self._state.value, target.value, details or "")
        self._event("state", source=self._state.value, target=target.value, **details)
        self._state = target
        self._entered = time.monotonic()
        if target is not RunState.RESIZING:
            self._release_barriers()

    def _restart(self, reason: str) -> None:
        """Leave the current generation: abort survivors' groups, probe members that did not exit."""
        self._transition(RunState.RESTARTING, reason=reason)
        for m in self._end_generation():
            self._track(self._pool.probe(m))

    def _end_generation(self) -> list[WorkerRecord]:
        """Tell the members still in the generation to leave it (their collectives fail, the loop
        unwinds); returns them."""
        staying = [m for m in self._members() if m.status is WorkerStatus.MEMBER]
        for m in staying:
            m.actor.end_generation.remote(self._generation)
        return staying

    def _count_failure(self, detail: str, raised: dict[int, BaseException] | None = None) -> None:
        self._failures += 1
        limit = self._failure.max_failures
        self._event("failure", count=self._failures, max_failures=limit, detail=detail[-2000:],
                    worker_failures=raised or {})
        if limit != -1 and self._failures > limit:
            self._fail(detail, raised)

    def _fail(self, error: str, raised: dict[int, BaseException] | None = None) -> None:
        """The run failed: `raised` holds what the user's code raised by rank, when that failed it."""
        self._error = error
        self._worker_failures = raised or {}
        self._transition(RunState.ERRORED)

    def _open_generation(self, candidates: list[WorkerRecord]) -> None:
        plan = plan_generation(candidates, self._generation, self._scaling.max_workers,
                               self._elastic.replicate_checkpoints)
        records = {w.worker_id: w for w in candidates}
        chosen, placements = [records[worker_id] for worker_id in plan.placements], plan.placements
        self._close_generation()
        self._generation += 1
        self._world_size = len(chosen)
        resume = self._resume_plan({w.worker_id for w in chosen})
        self._ledger.rewind(resume.index if resume else 0)
        self._max_index = resume.index if resume else 0
        self._resize_at = None
        self._cadence.forget_in_flight()
        master = records[plan.master]
        peers = {w.worker_id: w.actor for w in chosen}
        opened = time.monotonic()
        for w in chosen:
            p = placements[w.worker_id]
            w.status, w.generation, w.rank, w.outcome = WorkerStatus.MEMBER, self._generation, p.rank, None
            w.last_report = (self._max_index, opened)
            assignment = Assignment(
                generation=self._generation,
                rank=p.rank,
                world_size=len(chosen),
                local_rank=p.local_rank,
                local_world_size=p.local_world_size,
                node_rank=p.node_rank,
                master_addr=master.ip,
                master_port=master.free_port,
                resume=resume,
                peers=peers,
                buddy=records[plan.buddies[w.worker_id]].actor if w.worker_id in plan.buddies else None,
                max_world_size=self._scaling.max_workers,
            )
            release(w, assignment)
        for w in self._pool.with_status(WorkerStatus.PARKED):
            w.rank = -1  # standby beyond max: not a member of this generation
        self._event(
            "generation",
            generation=self._generation,
            world_size=len(chosen),
            members={w.worker_id: {"rank": placements[w.worker_id].rank, "pid": w.pid, "node": w.node_id} for w in chosen},
            resume_index=resume.index if resume else None,
            resume_from="storage" if resume and resume.stored else ("memory" if resume else None),
        )
        self._transition(RunState.RUNNING, generation=self._generation, world_size=len(chosen))

    def _resume_plan(self, live: set[int]) -> ResumePlan | None:
        """The newest checkpoint there is: served from survivors' memory, else loaded from storage."""
        return policy.resume_from(self._ledger.resume_plan(live, self._holds()), self._commits.newest)

    def _leaving_released(self) -> bool:
        """Workers under a preemption notice leave once the generation they were in has ended: first
        they hand what only they hold of the resume checkpoint to a staying worker's memory, then they
        stop, freeing their slot for the replacement requested when the notice came. True once no
        such worker is waiting; a new generation opens only then."""
        leaving = [w for w in self._pool.with_status(WorkerStatus.PARKED) if w.leaving]
        if not leaving:
            return True
        if self._handover is None and not any(m.status is WorkerStatus.MEMBER for m in self._members()):
            self._handover = self._track(self._hand_over(leaving))
        return False

    async def _hand_over(self, leaving: list[WorkerRecord]) -> None:
        leaving_ids = {w.worker_id for w in leaving}
        staying = [w for w in self._members() if w.status is WorkerStatus.PARKED and w.worker_id not in leaving_ids]
        whole = self._ledger.resume_plan({w.worker_id for w in leaving + staying}, self._holds())
        kept = self._ledger.resume_plan({w.worker_id for w in staying}, self._holds())
        do = policy.hand_over(whole, kept, anyone_stays=bool(staying))
        flush = whole if do is policy.HandOver.STORE else None
        try:
            if do is policy.HandOver.MOVE:
                target = min(staying, key=lambda w: w.rank)
                await asyncio.gather(*[self._hand_over_part(self._pool.records[wid], target, whole, names)
                                       for wid, names in whole.holders.items() if wid in leaving_ids])
        finally:
            for w in leaving:
                release(w, Stop("left under a preemption notice", flush=flush))
                # Out of the generation (not a member lost from it) and gone.
                self._event("worker_left", worker_id=w.worker_id, pid=w.pid, rank=w.rank, node_id=w.node_id,
                            generation=w.generation, cause=LostCause.PREEMPTED.value)
                w.status, w.lost_reason, w.rank = WorkerStatus.LOST, "left under a preemption notice", -1
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
        target.holds.add((plan.generation, plan.index))
        self._event("checkpoint_handed_over", source=source.worker_id, target=target.worker_id, index=plan.index,
                    names=names)

    def _drop_hung_workers(self, now: float) -> None:
        """The progress watchdog: heartbeats come from a thread and prove the process, not the loop."""
        running = [m for m in self._members() if m.status is WorkerStatus.MEMBER]
        stall = policy.stalled([policy.Progress(m.worker_id, *m.last_report) for m in running], now,
                        self._elastic.progress_timeout_s)
        for worker_id in stall.hung:
            self._pool.lose(self._pool.records[worker_id], LostCause.HUNG, f"no report for over progress_timeout_s="
                                                 f"{self._elastic.progress_timeout_s}s while its peers were ahead")
        if stall.restart:
            self._restart(f"no member reported within progress_timeout_s={self._elastic.progress_timeout_s}s")

    def _stop(self, reason: str) -> Stop:
        """The Stop for a worker when the run ends, with the checkpoint to store before it goes."""
        return Stop(reason, flush=self._final_flush)

    def _unstored_newest(self) -> ResumePlan | None:
        """The newest checkpoint the workers hold in memory, if storage has nothing of it: a failed
        run's last one, or a finished run's when its last generation reported nothing (the group
        re-formed at the loop's last report; its new session had no step left to run and so nothing
        of its own to flush)."""
        newest = self._ledger.resume_plan(self._pool.live_ids(), self._holds())
        return policy.final_flush(newest, self._commits.newest.index if self._commits.newest else 0,
                                  self._ledger.entries.get(newest.index) if newest else None,
                                  failed=self._state is RunState.ERRORED)

    async def _members_leave(self) -> None:
        """A failed run's members that are still in the generation (a peer raised while they wait in a
        collective) leave it first, within `drain_timeout_s`: their last reports, sent as they leave,
        are recorded. A report every rank made before the failure then counts, in the run's metrics and
        in the checkpoint its holders store."""
        staying = self._end_generation()
        await self._until(lambda: all(m.outcome is not None or m.status is WorkerStatus.LOST for m in staying),
                          self._elastic.drain_timeout_s)

    async def _shut_down(self) -> None:
        reason = "run finished" if self._state is RunState.FINISHED else "run failed"
        if self._state is RunState.ERRORED:
            await self._members_leave()
        self._final_flush = self._unstored_newest()
        self._flush_chosen.set()
        self._pool.end_all(self._stop(reason), now=False)
        self._event("run_ended", state=self._state.value)
        # Members leave after flushing their last checkpoint; its commit is a task of its own.
        flushing = self._final_flush is not None
        deadline = time.monotonic() + self._elastic.drain_timeout_s + (
            self._elastic.persist_flush_timeout_s if flushing else 0.0)
        while self._tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
        self._pool.end_all(self._stop(reason), now=True)  # whatever has not ended by now is ended here
        await self._commits.close(self._elastic.storage_retry_deadline_s)

    def _track(self, coroutine: Any) -> asyncio.Future:
        """Run `coroutine` as a task that shutdown waits for."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _event(self, kind: str, **details: Any) -> None:
        now = time.monotonic()
        entry = {"t": round(now - self._started, 4), "time": time.time(), "kind": kind, **details}
        self._events.append(entry)
        self._exported.event(entry, now)
        self._fed.set()

    def _settled(self, generation: int, index: int, committed: CommittedCheckpoint | None) -> None:
        """Checkpoint `index` of `generation` was committed, or never will be (None)."""
        self._cadence.settled(index)
        self._feed.settle(generation, index, committed)
        self._fed.set()

    def _settle_hopeless(self) -> None:
        """Reports held back for a checkpoint that can no longer commit are let through without it: its
        generation rewound past it, a part was given up, a worker that had to store a part (or, for
        one the loop stored itself, every rank that registered it) is gone; or, under a cadence that
        replaces waiting uploads, a newer generation's checkpoint replaced it before its upload began."""
        live, members = self._pool.live_ids(), {w.rank: w.worker_id for w in self._members()}
        for generation, index in self._feed.awaiting():
            if policy.hopeless(self._ledger.entries.get(index), generation, current_generation=self._generation,
                               live=live, members=members, replaceable=self._cadence.replaceable):
                self._settled(generation, index, None)

    def _holds(self) -> dict[int, set[tuple[int, int]]]:
        """What each parked worker holds in memory (it told at parking; replicas it took since are added)."""
        return {w.worker_id: w.holds for w in self._pool.with_status(WorkerStatus.PARKED)}

    def _is_member(self, w: WorkerRecord) -> bool:
        return w.generation == self._generation and w.rank >= 0

    def _members(self) -> list[WorkerRecord]:
        return [w for w in self._pool.records.values() if self._is_member(w)]

    def _standby(self) -> list[WorkerRecord]:
        return [w for w in self._pool.with_status(WorkerStatus.PARKED) if not self._is_member(w)]

    # == called by workers ==========================================================================
    async def _record(self, worker_id: int) -> WorkerRecord | None:
        """The record of a calling worker, once adoption is done; None for one that was not adopted."""
        await self._adopted.wait()
        return self._pool.records.get(worker_id)

    async def worker_started(self, worker_id: int, node_id: str, ip: str, pid: int) -> None:
        w = await self._record(worker_id)
        if w is None:
            return
        if w.status is WorkerStatus.PENDING:
            w.status = WorkerStatus.STARTING
        w.node_id, w.ip, w.pid, w.last_heartbeat = node_id, ip, pid, time.monotonic()
        self._wake.set()

    async def park(self, worker_id: int, outcome: Outcome, free_port: int) -> Assignment | Stop:
        """A worker left its generation (or is new) and waits for its next place."""
        w = await self._record(worker_id)
        if w is None:
            return Stop("this worker was not adopted by the restarted supervisor")
        if self._state.terminal:
            if self._is_member(w) and outcome.generation == self._generation:
                w.outcome = outcome  # what it raised belongs to the failure that ended the run
                self._fed.set()  # `_members_leave` waits for it
            await self._flush_chosen.wait()
            return self._stop("run is over")
        if w.status is WorkerStatus.LOST:
            if w.actor is None:
                return Stop("this worker was declared dead")
            self._event("fenced_worker_rejoined", worker_id=worker_id, pid=w.pid, old_generation=outcome.generation)
            w.rank = -1
        if w.leaving and not self._is_member(w):
            return Stop("left under a preemption notice")  # a standby: nothing to hand over
        if outcome.unagreed is not None and self._is_member(w) and outcome.generation == self._generation:
            self._unagreed(w, outcome.unagreed)
        w.status, w.outcome, w.free_port = WorkerStatus.PARKED, outcome, free_port
        w.holds = {(held.generation, held.index) for held in outcome.held}
        self._ledger.note_held(worker_id, outcome.held)
        w.last_heartbeat = time.monotonic()
        w.waiting = asyncio.get_running_loop().create_future()
        waiting = w.waiting
        self._wake.set()
        return await waiting

    async def heartbeat(self, worker_id: int, generation: int | None, facts: dict[str, float]) -> HeartbeatReply:
        """A heartbeat through Ray: a worker's first, or its fallback when its datagrams go unanswered.
        The reply names the channel for the next ones."""
        w = await self._record(worker_id)
        self._heartbeats["ray"] += 1
        reply = self._heartbeat(w, worker_id, generation, facts)
        reply.channel = self._channel
        return reply

    def _beat(self, beat: Beat) -> HeartbeatReply | None:
        """A heartbeat datagram (heartbeats.py); none is answered before adoption is done."""
        if not self._adopted.is_set():
            return None
        self._heartbeats["udp"] += 1
        facts = {"rss_bytes": beat.rss_bytes, "cpu_percent": beat.cpu_percent, "report_index": beat.report_index}
        return self._heartbeat(self._pool.records.get(beat.worker_id), beat.worker_id, beat.generation, facts)

    def _heartbeat(self, w: WorkerRecord | None, worker_id: int, generation: int | None,
                   facts: dict[str, float]) -> HeartbeatReply:
        if w is None:
            return HeartbeatReply(active_generation=None, fenced=True)
        fenced = w.status is WorkerStatus.LOST
        if fenced:
            self._event("fenced_heartbeat", worker_id=worker_id, pid=w.pid, generation=generation)
        else:
            w.last_heartbeat = time.monotonic()
            w.facts = facts
            entered = int(facts.get("report_index", -1))  # a report still on its way, or held in the barrier
            if generation == self._generation and self._is_member(w) and entered > w.last_report[0]:
                w.last_report = (entered, w.last_heartbeat)
        active = self._generation if self._state in (RunState.RUNNING, RunState.RESIZING) else None
        return HeartbeatReply(active_generation=active, fenced=fenced)

    async def report(self, worker_id: int, report: Report) -> ReportReply:
        """Record a report of a member that carries a checkpoint, or comes with one of a peer's. The
        reply waits until every member has made this report, and says whether to store the
        checkpoint; a generation that ends meanwhile answers it (refused)."""
        w = await self._record(worker_id)
        entry = self._record_report(w, report) if w is not None else None
        if entry is None or self._rejects(w, report.generation, report.index):  # recorded, but too late to answer
            return ReportReply(accepted=False)
        if not entry.complete:
            await self._barriers.setdefault(report.index, asyncio.Event()).wait()
        if self._rejects(w, report.generation, report.index):
            return ReportReply(accepted=False)
        persist = bool(entry.persist) and not entry.registered
        return ReportReply(accepted=True, unwind=entry.unwind, persist=persist,
                           upload=persist and w.worker_id in entry.uploaders(),
                           replaceable=self._cadence.replaceable, dir_name=entry.dir_name,
                           list_stored=report.registered and w.rank == min(entry.registered_by))

    async def reports(self, worker_id: int, batch: list[Report]) -> None:
        """Reports of a member that need no decision (no checkpoint, or a live dict part not due to be
        stored): nothing to answer, so the worker sends them in batches, in order
        (worker/report_sender.py), the last ones as its generation ends."""
        w = await self._record(worker_id)
        if w is not None:
            for report in batch:
                self._record_report(w, report)

    def _record_report(self, w: WorkerRecord, report: Report) -> ReportEntry | None:
        """Record a member's report in the ledger; once every member made it, it counts (history,
        feed, pace) and its waiting peers are released. None: refused (a stale generation)."""
        generation, index = report.generation, report.index
        if self._stale(w, generation, index):
            return None
        world_size = self._world_size
        entry = self._ledger.record(generation, world_size, index, w.rank, w.worker_id, report.names, report.metrics,
                                    report.loader_states)
        w.last_report = (index, time.monotonic())
        if report.pace is not None:
            self._paces.setdefault((generation, index), {})[w.worker_id] = report.pace
        entry.dir_name = entry.dir_name or report.dir_name
        if report.registered:  # the loop stored it itself: committed once a rank has listed it (`part_persisted`)
            entry.registered = entry.persist = True
            entry.registered_by.add(w.rank)
        elif report.store is not None:  # a live dict part: stored if one of its ranks found it due
            entry.persist = True if report.store else entry.persist
        elif report.names is not None and entry.persist is None:
            # A SYNC report waits for its commit: it is stored whatever the cadence.
            entry.persist = report.sync or self._cadence.choose(index, time.monotonic())
        self._max_index = max(self._max_index, index)
        if entry.complete and not entry.made:  # made once every rank made it: then it counts
            # Decided once, when the last rank reports: every rank unwinds after the same report.
            entry.unwind = self._resize_at is not None and index >= self._resize_at
            self._made(entry, index, entry.metrics_by_rank.get(0))  # None: made before a supervisor restart
            self._watch_pace(index, self._paces.pop((generation, index), {}))
            barrier = self._barriers.pop(index, None)
            if barrier is not None:
                barrier.set()
        return entry

    def _made(self, entry: ReportEntry, index: int, metrics: dict[str, Any] | None) -> None:
        """Report `index` was made by every rank: it goes into the history (with `metrics`) and the feed."""
        entry.made = True
        made_at = time.time()
        if metrics is not None:
            self._metrics = dict(metrics)
            self._history.append({**metrics, "_index": index, "_generation": entry.generation,
                                  "_world_size": entry.world_size, "_time": made_at})
        self._feed.made(ReportRecord(index, entry.generation, entry.world_size,
                                     [entry.metrics_by_rank.get(r, {}) for r in range(entry.world_size)], time=made_at),
                        awaits_commit=bool(entry.persist))
        self._fed.set()
        self._commits.commit_if_ready(index, entry)  # its stored part may have come before its last report
        self._ledger.prune()

    def _unagreed(self, w: WorkerRecord, report: Report) -> None:
        """A survivor parks holding the live dict part of a report whose barrier failed after its step
        made a collective with every peer (worker/session.py `_keep_unagreed`): that report counts as
        made, and the next generation may resume from it instead of an older checkpoint."""
        entry = self._ledger.record_unagreed(report.generation, self._world_size, report.index, w.rank, w.worker_id,
                                             report.names or [], report.metrics, report.loader_states)
        entry.dir_name = entry.dir_name or report.dir_name
        if entry.persist is None:
            entry.persist = bool(report.store)
        self._event("report_unagreed_kept", worker_id=w.worker_id, rank=w.rank, generation=report.generation,
                    index=report.index)

    def _close_generation(self) -> None:
        """The generation ended and its survivors parked (their last reports flushed): the reports that
        some rank's report never came for were made by every rank all the same (ledger.close)."""
        for index, entry in self._ledger.close(self._generation):
            self._paces.pop((self._generation, index), None)
            self._made(entry, index, entry.metrics_by_rank[min(entry.metrics_by_rank)])  # rank 0's, or the lowest's

    def _watch_pace(self, index: int, paces: dict[int, Pace]) -> None:
        """Report `index`, which every member made, with each one's pace: flag stragglers and growing
        memory (pace.py), and export it."""
        members = {w.worker_id: w for w in self._members()}
        self._exported.made(index, paces, members, time.monotonic())
        step_times = {worker: pace.step_s for worker, pace in paces.items()}
        rss = {worker: pace.rss for worker, pace in paces.items()}
        new, cleared, growing = self._pace.observe(step_times, rss)
        for worker_id in sorted(new):
            w = members.get(worker_id)
            self._event("straggler", index=index, worker_id=worker_id, rank=w.rank if w else None,
                        node_id=w.node_id if w else None, step_s=round(step_times[worker_id], 4),
                        median_step_s=round(peer_medians(step_times)[worker_id], 4),
                        reports=self._elastic.straggler_reports)
        for worker_id in sorted(cleared):
            self._event("straggler_cleared", index=index, worker_id=worker_id, step_s=round(step_times[worker_id], 4))
        for worker_id in sorted(growing):
            w = members.get(worker_id)
            self._event("memory_growing", index=index, worker_id=worker_id, rank=w.rank if w else None,
                        rss_mb=round(rss[worker_id] / 2**20, 1), reports=self._elastic.memory_growth_reports)

    def _rejects(self, w: WorkerRecord, generation: int, index: int) -> bool:
        """A report of a generation that is over, or of a fenced worker, is refused."""
        return self._stale(w, generation, index) or self._state not in (RunState.RUNNING, RunState.RESIZING)

    def _stale(self, w: WorkerRecord, generation: int, index: int) -> bool:
        """A report is not recorded when it is of a generation before the latest, or of a fenced
        worker. One of the latest generation is, even once it ended: its barrier passed before it was
        sent, so it was made (the sender flushes its reports before it parks)."""
        current = generation == self._generation and w.status is WorkerStatus.MEMBER
        if current and not self._flush_chosen.is_set():
            return False
        if not current:
            self._event("stale_report_rejected", worker_id=w.worker_id, pid=w.pid, generation=generation,
                        index=index, current_generation=self._generation)
        return True

    def _release_barriers(self) -> None:
        """The generation ended: reports waiting for their peers are answered (and refused)."""
        for barrier in self._barriers.values():
            barrier.set()
        self._barriers.clear()
        self._agreements.release()
        self._paces.clear()  # of reports that will never be made

    async def feed(self, report_cursor: int, event_cursor: int, timeout_s: float, incarnation: str = "") -> Feed:
        """For the driver's callbacks: the reports (settled, in order) and events after the cursors;
        waits up to `timeout_s` for one. After Ray restarted the supervisor (the cursors are of another
        `incarnation`), reports count from this one's start, and events go on from the driver's cursor
        within the predecessor's stored events this one's log starts with."""
        await self._adopted.wait()
        if incarnation != self._incarnation:  # this one's log starts with its predecessor's stored events
            report_cursor, event_cursor = 0, min(event_cursor, self._log.inherited)
        await self._until(lambda: self._closed or bool(self._feed.since(report_cursor))
                          or len(self._events) > event_cursor, timeout_s)
        reports, events = self._feed.since(report_cursor), self._events[event_cursor:]
        return Feed(reports, events, report_cursor + len(reports), event_cursor + len(events),
                    over=self._closed and self._feed.done, incarnation=self._incarnation)

    async def _until(self, condition: Any, timeout_s: float) -> bool:
        """Wait until `condition()` holds (checked whenever a report settles or an event is recorded);
        False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._fed.clear()
            try:
                await asyncio.wait_for(self._fed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return True

    async def checkpoint_settled(self, generation: int, index: int,
                                 timeout_s: float) -> tuple[CommittedCheckpoint | None, bool]:
        """For `report(checkpoint_upload_mode=SYNC / NO_UPLOAD)`: wait until checkpoint `index` of
        `generation` is committed, or known never to be (None); and whether `generation` is over."""
        await self._adopted.wait()
        await self._until(lambda: (generation, index) not in self._feed.awaiting() or self._over(generation),
                          timeout_s)
        committed = next((c for c in self._commits.committed if (c.generation, c.index) == (generation, index)), None)
        return committed, self._over(generation)

    def _over(self, generation: int) -> bool:
        """Has `generation` ended (its members are to leave it)?"""
        return generation != self._generation or self._state not in (RunState.RUNNING, RunState.RESIZING)

    async def reported_checkpoints(self, generation: int, index: int,
                                   timeout_s: float) -> list[tuple[CommittedCheckpoint, dict[str, Any]]]:
        """For `get_all_reported_checkpoints()`: once the checkpoints reported up to `index` of
        `generation` are settled, the committed ones, oldest first, with the metrics reported beside them."""
        await self._adopted.wait()
        await self._until(lambda: self._over(generation)
                          or not any(g == generation and i <= index for g, i in self._feed.awaiting()), timeout_s)
        return [(c, c.metrics) for c in self._commits.committed]

    async def upload_waited(self, worker_id: int, index: int, waited_s: float) -> None:
        """A worker's report waited for its earlier checkpoints' uploads (storage behind the reports)."""
        self._event("report_waited_for_upload", worker_id=worker_id, index=index, waited_s=round(waited_s, 3))

    async def stop_run(self, reason: str) -> None:
        """End the run cleanly, as if its loop had returned (Tune stopped the trial, say): members
        leave their generation, the newest checkpoint in memory is stored, torn folders are swept."""
        await self._adopted.wait()
        if self._state.terminal or self._stopping is not None:
            return
        self._stopping = reason
        self._event("stop_requested", reason=reason)
        self._wake.set()

    async def part_persisted(self, worker_id: int, generation: int, index: int, facts: dict[str, Any],
                             upload_s: float | None = None) -> None:
        """A worker stored its part of checkpoint `index` of `generation` (see commits.py), in
        `upload_s` (None: the loop stored it itself)."""
        w = await self._record(worker_id)
        if w is not None and upload_s is not None:
            self._exported.uploaded(w, sum(f["size"] for f in facts.values()), upload_s)
        self._commits.part_persisted(worker_id, generation, index, facts)

    async def replica_held(self, worker_id: int, generation: int, index: int, names: list[str],
                           parked: bool = False, facts: dict[str, dict[str, Any]] | None = None) -> None:
        """A worker holds a copy of a peer's part of checkpoint `index` (see worker/replicator.py, and
        the hand-over of a leaving worker), with the `facts` its files were reported with. `parked`:
        it took it out of a generation, where nothing is evicted, so it still holds it."""
        w = await self._record(worker_id)
        self._ledger.record_replica(generation, index, worker_id, names,
                                    self._world_size if generation == self._generation else None, facts)
        if parked and w is not None and w.status is WorkerStatus.PARKED:
            w.holds.add((generation, index))

    async def copy_corrupt(self, worker_id: int, generation: int, of_generation: int, index: int, holder: int,
                           name: str, problem: str) -> None:
        """A member of `generation` was served file `name` of checkpoint `index` (of `of_generation`)
        from worker `holder`'s memory, and it is not what its report made. That copy is never planned
        from again, and the generation ends: the next one resumes from another copy, storage, or an
        older checkpoint."""
        w = await self._record(worker_id)
        if self._ledger.mark_corrupt(of_generation, index, holder, name):
            self._event("checkpoint_copy_corrupt", worker_id=worker_id, holder=holder, generation=of_generation,
                        index=index, name=name, problem=problem)
        if w is not None and self._is_member(w) and not self._over(generation):
            self._restart(f"checkpoint {index} served from worker {holder}'s memory is corrupt: {problem}")

    async def persist_given_up(self, worker_id: int, generation: int, index: int, reason: str) -> None:
        """A worker could not store its part of checkpoint `index` before the retry deadline."""
        await self._adopted.wait()
        entry = self._ledger.entries.get(index)
        if entry is not None and entry.generation == generation:
            entry.given_up = True
            self._settled(generation, index, None)
        self._event("persist_given_up", worker_id=worker_id, index=index, reason=reason)

    async def preemption_notice(self, worker_id: int, source: str, seconds_left: float | None) -> None:
        """A worker's machine is about to go (SIGTERM, a cloud's notice)."""
        w = await self._record(worker_id)
        if w is not None:
            self._notice(w, source, seconds_left)

    def _notice(self, w: WorkerRecord, source: str, seconds_left: float | None) -> None:
        """Re-form the group without a worker under a notice, while it still serves its checkpoint
        from memory: at the next report; or, when the loop asks `get_preemption_info()`, at the report
        after the call that tells it (the loop saves a checkpoint there, so no step is redone)."""
        if w.leaving or w.status is WorkerStatus.LOST or self._state.terminal:
            return
        w.leaving = True
        self._notices.noted(w.worker_id, seconds_left)
        if source != "sigterm":  # the machine goes: its replacement is placed elsewhere
            self._pool.leaving_nodes.add(w.node_id)
        self._event("preemption_notice", worker_id=w.worker_id, pid=w.pid, rank=w.rank, node=w.node_id,
                    source=source, seconds_left=seconds_left)
        if self._state is RunState.RUNNING and self._is_member(w):
            if self._notices.preempted():
                self._preemption = notices.preemption_info(self._leaving())
                self._fail(f"preempted {self._notices.count} times, over FailureConfig.max_preemption_failures="
                           f"{self._failure.max_preemption_failures}")
                return
            asks = self._generation in self._notices.asked_in
            self._resize_after(None if asks else self._max_index + 1)
            self._transition(RunState.RESIZING, reason=f"worker {w.worker_id} preempted",
                             at="the report after get_preemption_info()" if asks else "the next report")
        elif not self._is_member(w):
            release(w, Stop("left under a preemption notice"))  # a standby: nothing to hand over
        self._pool.top_up()
        self._wake.set()

    def _leaving(self) -> list[notices.Leaving]:
        return [notices.Leaving(m.rank, m.node_id, self._notices.deadlines.get(m.worker_id))
                for m in self._members() if m.leaving]

    async def preemption_info(self, worker_id: int, generation: int, call: int, index: int) -> tuple[bool, Any]:
        """`get_preemption_info()` call number `call` of a member, made after report `index`: every
        rank gets the same answer (see notices.py). Returns (accepted, info); not accepted: the
        worker's generation is over."""
        self._notices.asked_in.add(generation)
        accepted, info = await self._agree(
            worker_id, generation, index, ("preemption_info", generation, call), None,
            lambda _: notices.preemption_info(self._leaving()), self._elastic.preemption_info_timeout_s,
            f"get_preemption_info() call {call}", "preemption_info_timeout_s")
        if info is not None and self._state is RunState.RESIZING and self._resize_at is None:
            self._resize_after(index + 1)  # the loop saw the notice: it re-forms after its next report
            self._event("resize_requested", at_report=self._resize_at, reason="the loop saw the preemption notice")
        return accepted, info

    async def collective(self, worker_id: int, generation: int, call: int, index: int, data: Any) -> tuple[bool, Any]:
        """Call number `call` of `collective.barrier()` / `broadcast_from_rank_zero(data)` by a member,
        made after report `index`: (accepted, rank 0's data) once every rank made it."""
        return await self._agree(worker_id, generation, index, ("collective", generation, call), data,
                                 lambda brought: brought.get(0), self._elastic.collective_timeout_s,
                                 f"elastic_train.collective call {call}", "collective_timeout_s")

    async def _agree(self, worker_id: int, generation: int, index: int, key: tuple, brought: Any,
                     decide: Any, timeout_s: float, what: str, setting: str) -> tuple[bool, Any]:
        """A call every member makes alike (agreement.py), made after report `index`: (accepted,
        the answer); not accepted: the worker's generation is over, the loop unwinds."""
        w = await self._record(worker_id)
        if w is None or self._rejects(w, generation, index):
            return False, None
        answer = await self._agreements.agree(key, w.rank, self._world_size, brought, decide, timeout_s, what, setting)
        if self._rejects(w, generation, index):
            return False, None
        return True, answer

    async def _every(self, interval_s: float, work: Any) -> None:
        """Await `work()` every `interval_s` while the run goes."""
        while not self._state.terminal:
            await work()
            await asyncio.sleep(interval_s)

    async def _write_events(self) -> None:
        """Write new events to the run's event log as the run goes (the last ones at its end)."""
        await asyncio.get_running_loop().run_in_executor(None, self._log.flush)

    async def _sample_metrics(self) -> None:
        self._exported.sample(self._members(), self._pace.stragglers, self._pace.growing, time.monotonic())

    async def _check_ray_drains(self) -> None:
        """Nodes that Ray drains (`ray drain-node`, KubeRay, the autoscaler) are preemption notices
        for the workers on them."""
        try:
            draining = await asyncio.get_running_loop().run_in_executor(
                None, ray._private.state.state.get_draining_nodes)
        except Exception as exc:  # noqa: BLE001 - a GCS hiccup: try again at the next poll
            logger.warning("could not read Ray's draining nodes: %r", exc)
            return
        for w in list(self._pool.records.values()):
            if w.node_id in draining and not w.leaving and w.status is not WorkerStatus.LOST:
                deadline = draining[w.node_id]
                self._notice(w, "ray_drain", max(0.0, deadline / 1000 - time.time()) if deadline else None)

    async def worker_actor(self, worker_id: int) -> Any:
        """The actor handle of a worker (for fault injectors attached from outside)."""
        w = await self._record(worker_id)
        return w.actor if w is not None else None

    async def storage_failed(self, worker_id: int, message: str) -> None:
        """A worker met a permanent storage error: the run cannot persist anything, so it fails."""
        await self._adopted.wait()
        self._event("storage_failed", worker_id=worker_id, message=message)
        self._storage_failed(message)

    def _storage_failed(self, message: str) -> None:
        """A permanent storage error: the run cannot persist anything, so it fails."""
        if not self._state.terminal:
            self._fail(message)
            self._wake.set()

    # == for the driver and tests ===================================================================
    async def status(self, events_since: int = 0) -> dict[str, Any]:
        """A snapshot for monitors and fault injectors attached from outside the driver (`elastic-train
        status`): the run's state, and per member its place, heartbeat age, last step time, RSS and flags."""
        now = time.monotonic()
        return {
            "state": self._state.value,
            "pid": os.getpid(),
            "generation": self._generation,
            "world_size": self._world_size,
            "index": self._max_index,
            "metrics": dict(self._metrics),
            "heartbeats": dict(self._heartbeats),
            "members": {
                w.worker_id: {"rank": w.rank, "pid": w.pid, "status": w.status.value, "node": w.node_id,
                              "ip": w.ip, **w.facts, "heartbeat_age_s": now - w.last_heartbeat,
                              "step_s": self._pace.last_step_s.get(w.worker_id),
                              "straggler": w.worker_id in self._pace.stragglers,
                              "memory_growing": w.worker_id in self._pace.growing}
                for w in self._members()
            },
            "events": self._events[events_since:],
        }
