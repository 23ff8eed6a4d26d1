"""Report intake: each member's reports are recorded in the ledger; once every member made one it
counts (the run's metrics and history, the driver's feed, pace) and its waiting peers go on. Also
the calls members make alike after a report (`collective`, `get_preemption_info()`: agreement.py),
and when a held-back report settles (its checkpoint committed, or known never to be)."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable
from typing import Any

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.config import ElasticConfig
from elastic_train.events import GenerationOpened, MemoryGrowing, ReportUnagreedKept, StaleReportRejected, Straggler, StragglerCleared
from elastic_train.protocol import Pace, Report, ReportRecord, ReportReply
from elastic_train.supervisor import policy
from elastic_train.supervisor.agreement import Agreements
from elastic_train.supervisor.checkpoints.cadence import StoreCadence
from elastic_train.supervisor.checkpoints.commits import Commits
from elastic_train.supervisor.checkpoints.feed import ReportFeed
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger, ReportEntry
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunView
from elastic_train.supervisor.watch.metrics import RunMetrics
from elastic_train.supervisor.watch.pace import PaceWatch, peer_medians
from elastic_train.supervisor.watch.telemetry import Telemetry


class Reports:
    def __init__(self, run: RunView, elastic: ElasticConfig, roster: Roster, ledger: CheckpointLedger,
                 commits: Commits, cadence: StoreCadence, telemetry: Telemetry, exported: RunMetrics):
        self._run = run
        self._elastic = elastic
        self._roster = roster
        self._ledger = ledger
        self._commits = commits
        self._cadence = cadence
        self._telemetry = telemetry
        self._exported = exported
        self.feed = ReportFeed()
        self.pace = PaceWatch(elastic.straggler_factor, elastic.straggler_reports, elastic.straggler_min_excess_s,
                              elastic.memory_growth_reports, elastic.memory_growth_min_mb * 2**20)
        self.metrics: dict[str, Any] = {}  # the last report every rank made: rank 0's metrics
        self.history: list[dict[str, Any]] = []  # in report order (generation, index)
        self._metrics_at: tuple[int, int] = (-1, -1)  # the (generation, index) of `metrics`
        self.latest = 0  # the highest report index of the current generation
        self.resize_at: int | None = None  # members unwind at this report (or the first after it)
        self._grows = False  # ... if it carries a checkpoint: newcomers join
        self._barriers: dict[int, asyncio.Event] = {}  # report index -> set when every member made it
        self._paces: dict[tuple[int, int], dict[int, Pace]] = {}  # (generation, index) -> worker -> its pace
        self._agreements = Agreements()

    # == a generation's reports ====================================================================
    def adopt(self, generation: int, world_size: int, members: list[WorkerRecord]) -> None:
        """A restarted supervisor adopted `members` of `generation`: their reports go on from theirs."""
        self._ledger.adopt(generation, world_size, members)
        self.open(max(m.index for m in members))
        self._telemetry.record(GenerationOpened(generation, world_size, {
            m.worker_id: {"rank": m.rank, "pid": m.pid, "node": m.node_id} for m in members}, adopted=True))

    def open(self, index: int) -> None:
        """A generation opens, resuming after report `index`."""
        self.latest, self.resize_at = index, None

    def unwind_after(self, index: int | None, members: list[WorkerRecord], generation: int, grow: bool = False) -> None:
        """Members leave the group at report `index` (or the first after it), for it to re-form; None:
        not yet (the loop asks `get_preemption_info()` first); `grow`: newcomers join, at the first such
        report that carries a checkpoint (worker/report/plan.py `leaves`). Reports without a checkpoint
        do not wait for a reply, so each member is told."""
        self.resize_at, self._grows = index, grow
        if index is not None:
            for m in members:
                m.actor.unwind_at.remote(generation, index, grow)

    def release(self) -> None:
        """The generation ended: reports waiting for their peers are answered (and refused)."""
        for barrier in self._barriers.values():
            barrier.set()
        self._barriers.clear()
        self._agreements.release()
        self._paces.clear()  # of reports that will never be made

    def close(self, generation: int) -> None:
        """Generation `generation` ended and its survivors parked (their last reports flushed): the
        reports that some rank's report never came for were made by every rank all the same."""
        for index, entry in self._ledger.close(generation):
            self._paces.pop((generation, index), None)
            self._made(entry, index, entry.metrics_by_rank[min(entry.metrics_by_rank)])  # rank 0's, or the lowest's

    # == intake ======================================================================================
    async def answer(self, w: WorkerRecord, report: Report) -> ReportReply:
        """Record a report that carries a checkpoint (or comes with one of a peer's); the reply waits
        until every member made it, and says whether to store the checkpoint."""
        entry = self.record(w, report)
        if entry is None or self.rejects(w, report.generation, report.index):  # recorded, but too late to answer
            return ReportReply(accepted=False)
        if not entry.complete:
            await self._barriers.setdefault(report.index, asyncio.Event()).wait()
        if self.rejects(w, report.generation, report.index):
            return ReportReply(accepted=False)
        store = bool(entry.to_store) and not entry.stored_by_loop
        return ReportReply(accepted=True, unwind=entry.unwind, store=store,
                           store_part=store and w.worker_id in entry.uploaders(),
                           replaceable=self._cadence.replaceable, dir_name=entry.dir_name,
                           list_stored=report.stored_by_loop and w.rank == min(entry.stored_by_ranks))

    def record(self, w: WorkerRecord, report: Report) -> ReportEntry | None:
        """Record a member's report in the ledger; once every member made it, it counts and its
        waiting peers are released. None: refused (a stale generation)."""
        generation, index = report.generation, report.index
        if self._stale(w, generation, index):
            return None
        entry = self._enter(w.rank, w.worker_id, report)
        self._roster.reported(w, index)
        peer = report.peer
        if peer is not None:  # its part came here at the barrier (worker/report/part_exchange.py)
            self._ledger.record_replica(generation, index, w.worker_id, peer.report.names or [],
                                        self._run.world_size, peer.facts)
            if peer.rank not in entry.reported_ranks:  # its own may never come: the peer made it all the same
                self._enter(peer.rank, peer.worker_id, peer.report)
        self.latest = max(self.latest, index)
        if entry.complete and not entry.made:  # made once every rank made it: then it counts
            # Decided once, when the last rank reports: every rank unwinds after the same report.
            entry.unwind = (self.resize_at is not None and index >= self.resize_at
                            and (not self._grows or bool(entry.parts) or entry.stored_by_loop))
            self._made(entry, index, entry.metrics_by_rank.get(0))
            self._watch_pace(index, self._paces.pop((generation, index), {}))
            barrier = self._barriers.pop(index, None)
            if barrier is not None:
                barrier.set()
        elif entry.made:  # made at a supervisor's adoption: rank 0's retried report brings its metrics now
            self._count(entry, index, entry.metrics_by_rank.get(0))
        return entry

    def _enter(self, rank: int, worker_id: int, report: Report) -> ReportEntry:
        """Enter rank `rank`'s report in the ledger (again, if a buddy's brought it first: alike)."""
        generation, index = report.generation, report.index
        entry = self._ledger.record(generation, self._run.world_size, index, rank, worker_id, report.names,
                                    report.metrics, report.loader_states)
        if report.pace is not None and not entry.made:
            self._paces.setdefault((generation, index), {})[worker_id] = report.pace
        entry.dir_name = entry.dir_name or report.dir_name
        if report.part_ranks is not None:
            entry.part_ranks = set(report.part_ranks)
        if report.stored_by_loop:  # the loop stored it itself: committed once a rank has listed it (`part_stored`)
            entry.stored_by_loop = True
            entry.stored_by_ranks.add(rank)
        entry.to_store = policy.to_store(entry.to_store, stored_by_loop=report.stored_by_loop, store=report.store,
                                        carries_files=report.names is not None, sync=report.sync,
                                        due=lambda: self._cadence.choose(index, time.monotonic()))
        return entry

    def unagreed(self, w: WorkerRecord, report: Report) -> None:
        """A survivor parks holding the live dict part of a report whose barrier failed after its step
        made a collective with every peer (worker/report/lockstep.py `_keep_unagreed`): that report counts as
        made, and the next generation may resume from it instead of an older checkpoint."""
        entry = self._ledger.record_unagreed(report.generation, self._run.world_size, report.index, w.rank,
                                             w.worker_id, report.names or [], report.metrics, report.loader_states)
        entry.dir_name = entry.dir_name or report.dir_name
        if entry.to_store is None:
            entry.to_store = bool(report.store)
        self._telemetry.record(ReportUnagreedKept(w.worker_id, w.rank, report.generation, report.index))

    def _made(self, entry: ReportEntry, index: int, metrics: dict[str, Any] | None) -> None:
        """Report `index` was made by every rank: it goes into the history (with `metrics`) and the feed."""
        entry.made = True
        self._count(entry, index, metrics)
        self.feed.made(ReportRecord(index, entry.generation, entry.world_size,
                                    [entry.metrics_by_rank.get(r, {}) for r in range(entry.world_size)],
                                    time=time.time()),
                       awaits_commit=bool(entry.to_store))
        self._telemetry.news()
        self._commits.commit_if_ready(index, entry)  # its stored part may have come before its last report
        self._ledger.prune()

    def _count(self, entry: ReportEntry, index: int, metrics: dict[str, Any] | None) -> None:
        """The metrics of made report `index` go into the run's metrics and history, once they are here
        (None: not yet): rank 0's report made before a supervisor restarted may come later, or never."""
        if metrics is None or entry.counted:
            return
        entry.counted = True
        # Reports may be counted out of order: adopted workers' retried calls after a supervisor restart.
        at = (entry.generation, index)
        if at > self._metrics_at:
            self.metrics, self._metrics_at = dict(metrics), at
        bisect.insort(self.history, {**metrics, "_index": index, "_generation": entry.generation,
                                     "_world_size": entry.world_size, "_time": time.time()},
                      key=lambda h: (h["_generation"], h["_index"]))

    def _watch_pace(self, index: int, paces: dict[int, Pace]) -> None:
        """Report `index`, which every member made, with each one's pace: flag stragglers and growing
        memory (supervisor/watch/pace.py), and export it."""
        members = {w.worker_id: w for w in self._run.members()}
        self._exported.made(index, paces, members, time.monotonic())
        step_times = {worker: pace.step_s for worker, pace in paces.items()}
        rss = {worker: pace.rss for worker, pace in paces.items()}
        new, cleared, growing = self.pace.observe(step_times, rss)
        for worker_id in sorted(new):
            w = members.get(worker_id)
            self._telemetry.record(Straggler(index, worker_id, w.rank if w else None, w.node_id if w else None,
                                             round(step_times[worker_id], 4),
                                             round(peer_medians(step_times)[worker_id], 4),
                                             self._elastic.straggler_reports))
        for worker_id in sorted(cleared):
            self._telemetry.record(StragglerCleared(index, worker_id, round(step_times[worker_id], 4)))
        for worker_id in sorted(growing):
            w = members.get(worker_id)
            self._telemetry.record(MemoryGrowing(index, worker_id, w.rank if w else None,
                                                 round(rss[worker_id] / 2**20, 1), self._elastic.memory_growth_reports))

    def rejects(self, w: WorkerRecord, generation: int, index: int) -> bool:
        """A report of a generation that is over, or of a fenced worker, is refused."""
        return self._stale(w, generation, index) or not self._run.state.training

    def _stale(self, w: WorkerRecord, generation: int, index: int) -> bool:
        """A report is not recorded when it is of a generation before the latest, or of a fenced
        worker. One of the latest generation is, even once it ended: its barrier passed before it was
        sent, so it was made (the sender flushes its reports before it parks)."""
        current = generation == self._run.generation and w.status is WorkerStatus.TRAINING
        if current and not self._run.flush_chosen:
            return False
        if not current:
            self._telemetry.record(StaleReportRejected(w.worker_id, w.pid, generation, index, self._run.generation))
        return True

    # == settling held-back reports ===================================================================
    def settle(self, generation: int, index: int, committed: CommittedCheckpoint | None) -> None:
        """Checkpoint `index` of `generation` was committed, or never will be (None)."""
        self._cadence.settled(index)
        self.feed.settle(generation, index, committed)
        self._telemetry.news()

    def settle_hopeless(self) -> None:
        """Reports held back for a checkpoint that can no longer commit are let through without it
        (policy.hopeless says which)."""
        live = self._roster.live_ids()
        members = {w.rank: w.worker_id for w in self._run.members()}
        for generation, index in self.feed.awaiting():
            if policy.hopeless(self._ledger.entries.get(index), generation, current_generation=self._run.generation,
                               live=live, members=members, replaceable=self._cadence.replaceable):
                self.settle(generation, index, None)

    # == calls every member makes alike ===============================================================
    async def agree(self, w: WorkerRecord | None, generation: int, index: int, key: tuple, brought: Any,
                    decide: Callable[[dict[int, Any]], Any], timeout_s: float, what: str,
                    setting: str) -> tuple[bool, Any]:
        """A call every member makes alike (agreement.py), made after report `index`: (accepted,
        the answer); not accepted: the worker's generation is over, the loop unwinds."""
        if w is None or self.rejects(w, generation, index):
            return False, None
        answer = await self._agreements.agree(key, w.rank, self._run.world_size, brought, decide, timeout_s, what,
                                              setting)
        if self.rejects(w, generation, index):
            return False, None
        return True, answer
