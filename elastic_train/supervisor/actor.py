"""`Supervisor`: the Ray actor of a run — its endpoints, and nothing else.

Workers call it (heartbeat, report, park, ...), the driver long-polls its feed, monitors ask its
status. Each endpoint waits until a restarted supervisor has adopted the workers, finds the caller's
record and hands the call to the part that owns it: the controller (controller.py, the only writer of
the run's state), report intake (reports.py), heartbeats (heartbeats.py), preemption
(preemption/workers.py), commits (checkpoints/commits.py).
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from typing import Any

import ray

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.config import CheckpointConfig, FailureConfig, ScalingConfig
from elastic_train.events import CheckpointCopyCorrupt, StoreGivenUp, ReportWaitedForUpload, StorageFailed
from elastic_train.protocol import Assignment, Feed, HeartbeatReply, Outcome, PartStored, Report, ReportReply, Stop
from elastic_train.run_folder.summary import RunSummary
from elastic_train.run_spec import WorkerSpec
from elastic_train.supervisor.adoption import worker_prefix
from elastic_train.supervisor.controller import Controller
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus


class Supervisor:
    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig, failure: FailureConfig,
                 checkpointing: CheckpointConfig):
        context = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's own property calls its deprecated `actor_id`
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = context.was_current_actor_reconstructed
        self._controller = Controller(spec, scaling, failure, checkpointing, worker_prefix(context.get_actor_id()),
                               adopting=restarted)
        self._elastic = spec.elastic
        self._incarnation = uuid.uuid4().hex  # tells the driver's feed a restarted supervisor from its predecessor

    async def run(self) -> RunSummary:
        return await self._controller.run()

    async def _record(self, worker_id: int) -> WorkerRecord | None:
        """The record of a calling worker, once adoption is done; None for one that was not adopted."""
        await self._controller.adopted.wait()
        return self._controller.roster.records.get(worker_id)

    # == workers: membership ==========================================================================
    async def worker_started(self, worker_id: int, node_id: str, ip: str, pid: int) -> bool:
        """A worker's process is up, on `node_id`. True: the run is under way, so the worker pays
        PyTorch's first-use costs before it parks (worker/warmup.py); the first generation's workers
        pay them in their loops, all at once."""
        w = await self._record(worker_id)
        if w is not None:
            self._controller.roster.started(w, node_id, ip, pid)
        return self._controller.under_way

    async def park(self, worker_id: int, outcome: Outcome, store_port: int) -> Assignment | Stop:
        """A worker left its generation (or is new) and waits for its next place."""
        w = await self._record(worker_id)
        if w is None:
            return Stop("this worker was not adopted by the restarted supervisor")
        return await self._controller.park(w, outcome, store_port)

    async def heartbeat(self, worker_id: int, generation: int | None, facts: dict[str, float]) -> HeartbeatReply:
        """A heartbeat through Ray: a worker's first, or its fallback when its datagrams go unanswered."""
        w = await self._record(worker_id)
        return self._controller.heartbeats.by_call(w, worker_id, generation, facts)

    async def preemption_notice(self, worker_id: int, source: str, seconds_left: float | None) -> None:
        """A worker's machine is about to go (SIGTERM, a cloud's notice)."""
        w = await self._record(worker_id)
        if w is not None:
            self._controller.notice(w, source, seconds_left)

    async def worker_actor(self, worker_id: int) -> Any:
        """The actor handle of a worker (for fault injectors attached from outside)."""
        w = await self._record(worker_id)
        return w.actor if w is not None else None

    # == workers: reports and the calls made alike ==================================================
    async def report(self, worker_id: int, report: Report) -> ReportReply:
        """A report that carries a checkpoint, or comes with one of a peer's: the reply waits until
        every member made it, and says whether to store the checkpoint; refused once its generation ended."""
        w = await self._record(worker_id)
        return await self._controller.reports.answer(w, report) if w is not None else ReportReply(accepted=False)

    async def reports(self, worker_id: int, batch: list[Report | PartStored]) -> None:
        """Reports that need no answer, and parts stored, sent in batches, in order (worker/report/sender.py)."""
        w = await self._record(worker_id)
        for item in batch:
            if isinstance(item, PartStored):
                self._part_stored(w, worker_id, item.generation, item.index, item.facts, item.upload_s)
            elif w is not None:
                self._controller.reports.record(w, item)

    async def preemption_info(self, worker_id: int, generation: int, call: int, index: int) -> tuple[bool, Any]:
        """`get_preemption_info()` call number `call`, made after report `index`: (accepted, info)."""
        return await self._controller.preemption.info(await self._record(worker_id), generation, call, index)

    async def collective(self, worker_id: int, generation: int, call: int, index: int, data: Any) -> tuple[bool, Any]:
        """Call number `call` of `collective.barrier()` / `broadcast_from_rank_zero(data)` by a member,
        made after report `index`: (accepted, rank 0's data) once every rank made it."""
        return await self._controller.reports.agree(await self._record(worker_id), generation, index,
                                             ("collective", generation, call), data, lambda brought: brought.get(0),
                                             self._elastic.collective_timeout_s,
                                             f"elastic_train.collective call {call}", "collective_timeout_s")

    # == workers: checkpoints ===========================================================================
    async def checkpoint_settled(self, generation: int, index: int,
                                 timeout_s: float) -> tuple[CommittedCheckpoint | None, bool]:
        """For `report(checkpoint_upload_mode=SYNC / NO_UPLOAD)`: wait until checkpoint `index` of
        `generation` is committed, or known never to be (None); and whether `generation` is over."""
        await self._controller.adopted.wait()
        feed = self._controller.reports.feed
        await self._controller.telemetry.until(
            lambda: (generation, index) not in feed.awaiting() or self._controller.over(generation), timeout_s)
        committed = next((c for c in self._controller.commits.committed
                          if (c.generation, c.index) == (generation, index)), None)
        return committed, self._controller.over(generation)

    async def reported_checkpoints(self, generation: int, index: int,
                                   timeout_s: float) -> list[tuple[CommittedCheckpoint, dict[str, Any]]]:
        """For `get_all_reported_checkpoints()`: once the checkpoints reported up to `index` of
        `generation` are settled, the committed ones, oldest first, with their metrics."""
        await self._controller.adopted.wait()
        feed = self._controller.reports.feed
        await self._controller.telemetry.until(lambda: self._controller.over(generation) or not any(
            g == generation and i <= index for g, i in feed.awaiting()), timeout_s)
        return [(c, c.metrics) for c in self._controller.commits.committed]

    async def upload_waited(self, worker_id: int, index: int, waited_s: float) -> None:
        """A worker's report waited for its earlier checkpoints' uploads (storage behind the reports)."""
        self._controller.telemetry.record(ReportWaitedForUpload(worker_id, index, round(waited_s, 3)))

    async def part_stored(self, worker_id: int, generation: int, index: int, facts: dict[str, Any],
                             upload_s: float | None = None) -> None:
        """A worker stored its part of checkpoint `index` of `generation` (see supervisor/checkpoints/commits.py), in
        `upload_s` (None: the loop stored it itself)."""
        self._part_stored(await self._record(worker_id), worker_id, generation, index, facts, upload_s)

    def _part_stored(self, w: WorkerRecord | None, worker_id: int, generation: int, index: int,
                     facts: dict[str, Any], upload_s: float | None) -> None:
        if w is not None and upload_s is not None:
            self._controller.exported.uploaded(w, sum(f["size"] for f in facts.values()), upload_s)
        self._controller.commits.part_stored(worker_id, generation, index, facts)

    async def replica_held(self, worker_id: int, generation: int, index: int, names: list[str],
                           parked: bool = False, facts: dict[str, dict[str, Any]] | None = None) -> None:
        """A worker holds a copy of a peer's part of checkpoint `index` (worker/hold/replicator.py, or a
        hand-over), with the `facts` its files were reported with. `parked`: it took it out of a
        generation, where nothing is evicted, so it still holds it."""
        w = await self._record(worker_id)
        run = self._controller
        run.ledger.record_replica(generation, index, worker_id, names,
                                  run.world_size if generation == run.generation else None, facts)
        if parked and w is not None and w.status is WorkerStatus.PARKED:
            self._controller.roster.holds_copy(w, generation, index, names)

    async def copy_corrupt(self, worker_id: int, generation: int, of_generation: int, index: int, holder: int,
                           name: str, problem: str) -> None:
        """A member of `generation` was served file `name` of checkpoint `index` (of `of_generation`)
        from worker `holder`'s memory, and it is not what its report made: that copy is never planned
        from again, and the generation ends."""
        w = await self._record(worker_id)
        if self._controller.ledger.mark_corrupt(of_generation, index, holder, name):
            self._controller.telemetry.record(CheckpointCopyCorrupt(worker_id, holder, of_generation, index, name,
                                                                    problem))
        self._controller.copy_corrupt(w, generation, index, holder, problem)

    async def store_given_up(self, worker_id: int, generation: int, index: int, reason: str) -> None:
        """A worker could not store its part of checkpoint `index` before the retry deadline."""
        await self._controller.adopted.wait()
        self._controller.commits.part_given_up(generation, index)
        self._controller.telemetry.record(StoreGivenUp(worker_id, index, reason))

    async def storage_failed(self, worker_id: int, message: str) -> None:
        """A worker met a permanent storage error: the run cannot store anything, so it fails."""
        await self._controller.adopted.wait()
        self._controller.telemetry.record(StorageFailed(worker_id, message))
        self._controller.fail_now(message)

    # == the driver, monitors and tests ==================================================================
    async def feed(self, report_cursor: int, event_cursor: int, timeout_s: float, incarnation: str = "") -> Feed:
        """For the driver's callbacks: the reports (settled, in order) and events after the cursors;
        waits up to `timeout_s` for one. After Ray restarted the supervisor (the cursors are of another
        `incarnation`), reports count from this one's start, and events go on from the driver's cursor
        within the predecessor's stored events this one's log starts with."""
        await self._controller.adopted.wait()
        feed, events = self._controller.reports.feed, self._controller.log.entries
        if incarnation != self._incarnation:
            report_cursor, event_cursor = 0, min(event_cursor, self._controller.log.inherited)
        await self._controller.telemetry.until(lambda: self._controller.closed or bool(feed.since(report_cursor))
                                        or len(events) > event_cursor, timeout_s)
        reports, new = feed.since(report_cursor), events[event_cursor:]
        return Feed(reports, new, report_cursor + len(reports), event_cursor + len(new),
                    over=self._controller.closed and feed.done, incarnation=self._incarnation)

    async def stop_run(self, reason: str) -> None:
        """End the run cleanly, as if its loop had returned (Tune stopped the trial, say): members
        leave their generation, the newest checkpoint in memory is stored, torn folders are swept."""
        await self._controller.adopted.wait()
        self._controller.stop(reason)

    async def abort_run(self, reason: str) -> None:
        """End the run now (Ctrl-C in the driver, as Ray Train's abort): it fails, its workers are ended
        at once, nothing more is stored."""
        await self._controller.adopted.wait()
        self._controller.fail_now(f"aborted: {reason}", abort=True)

    async def status(self, events_since: int = 0) -> dict[str, Any]:
        """A snapshot for monitors and fault injectors attached from outside the driver (`elastic-train
        status`): the run's state, and per member its place, heartbeat age, last step time, RSS and flags."""
        now, run, pace = time.monotonic(), self._controller, self._controller.reports.pace
        return {
            "state": run.state.value,
            "pid": os.getpid(),
            "generation": run.generation,
            "world_size": run.world_size,
            "index": run.reports.latest,
            "metrics": dict(run.reports.metrics),
            "heartbeats": dict(run.heartbeats.counts),
            "members": {
                w.worker_id: {"rank": w.rank, "pid": w.pid, "status": w.status.value, "node": w.node_id,
                              "ip": w.ip, **w.facts, "heartbeat_age_s": now - w.last_heartbeat,
                              "step_s": pace.last_step_s.get(w.worker_id),
                              "straggler": w.worker_id in pace.stragglers,
                              "memory_growing": w.worker_id in pace.growing}
                for w in run.members()
            },
            "events": run.log.entries[events_since:],
        }
