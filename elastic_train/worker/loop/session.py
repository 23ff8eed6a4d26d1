"""What the user's loop talks to inside a worker: report, get_checkpoint, get_context.

One `TrainSession` lives per generation. `report()` keeps an in-memory snapshot of the checkpoint
(the state survivors resume from), waits for every rank at a barrier over the process group
(worker/report/lockstep.py), tells the supervisor, hands the snapshot to the store queue (worker/store/storing.py), and unwinds
the loop with `GenerationEnded` when the group is about to be re-formed. A report without a
checkpoint does not wait for the supervisor: its metrics are sent and the loop goes on. What each
report does is decided by worker/report/plan.py; where the loop resumes from, by worker/loop/resume.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, TypeVar

import ray
import torch

from elastic_train.checkpoint.checkpoint import Checkpoint, needs_replica
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.manifest import facts_soon
from elastic_train.checkpoint.modes import CheckpointUploadMode
from elastic_train.errors import GenerationEnded, PeerLost
from elastic_train.faithful import reads
from elastic_train.protocol import HeldCheckpoint, Pace, Position, PreemptionInfo, Report
from elastic_train.worker.group.world import collectives_made
from elastic_train.worker.hold.kept_state import KeptState
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.loop.context import TrainContext
from elastic_train.worker.loop.host import SessionSetup, WorkerServices
from elastic_train.worker.loop.loaders import Loaders, StatefulLoader
from elastic_train.worker.loop.resume import Resume
from elastic_train.worker.loop.step_clock import StepClock
from elastic_train.worker.report.barrier import all_wait, pipelines
from elastic_train.worker.report.intake import take
from elastic_train.worker.report.lockstep import Lockstep, MadeReport
from elastic_train.worker.report.part_exchange import PartExchange
from elastic_train.worker.report.plan import Carries, after_barrier, plan_report
from elastic_train.worker.report.share_copies import ShareCopies
from elastic_train.worker.store.queue import PartToStore
from elastic_train.worker.store.storing import PartStoring

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TrainSession:
    def __init__(self, setup: SessionSetup, host: WorkerServices):
        self.worker_id = setup.worker_id
        self.context: TrainContext = setup.context
        self._setup, self._host = setup, host
        self._resume = Resume(setup, host)
        self._lockstep = Lockstep(host, setup.context.get_world_size())
        self._storing = PartStoring(setup, host)
        self._clock = StepClock()
        self._leaving_at: int | None = None  # the report after which every rank leaves, told alike (preemption_info)
        self.index = self._resume.index
        self._loaders = Loaders(self._resume.loader_states, setup.loop.datasets, setup.loop.data_context)
        self._kept: KeptState | None = None  # prepare_model(model, live_state=True)
        self._shares: ShareCopies | None = None  # when a sharded kept state's share is copied
        self._restored: Checkpoint | None = None
        self._latest: Checkpoint | None = None  # the newest this rank reported, once stored
        self._pending: tuple[int, int] | None = None  # (generation, index) of a newer one, until it is committed
        self._restored_loaded = False
        self._preemption_calls = 0
        self._collective_calls = 0
        self._reduced = (self.index, 0, collectives_made())  # (report index, gradient reductions since, collectives until the last)
        self._went_on_from: Position | None = None  # where the loop last went on in place
        self._bound_to_world = False
        self._reduces_steps = False  # the step's gradients go through our comm hook (worker/group/reduction.py)
        self._exchange = PartExchange(setup.worker_id, host.hold_replica)  # small parts to the buddy (worker/report/part_exchange.py)
        self.reads = reads.PlaceReads()  # what the loop read of its place (faithful/reads.py)

    # -- the user's API -------------------------------------------------------------------------
    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None, *,
               dir_name: str | None = None, mode: CheckpointUploadMode = CheckpointUploadMode.ASYNC, delete_local: bool = False,
               upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None) -> None:
        """Snapshot the checkpoint, wait for every rank, tell the supervisor, hand the part to the
        store queue; return once every rank has made this report (and, for SYNC and NO_UPLOAD, once the
        checkpoint is committed). `report()` is a barrier, as in Ray Train: no rank runs a step ahead
        of a lost peer's last report, even in a loop with no collective, so at most one step is
        redone; and the newest checkpoint every rank reported is the oldest this worker may still
        need, never evicted by the snapshot kept here. A dict checkpoint is held as the live tensors
        it names (worker/hold/live_part.py), serialized only to be stored.

        Where we differ: a report with no checkpoint after one with none (worker/report/barrier.py `goes_on`)
        returns before the other ranks made it, its barrier awaited by the next report (or as the loop
        ends); its metrics go to the supervisor in the background once every rank made it. It costs
        ~0.2 ms; a rank runs at most one step ahead of the others (none in a loop whose step makes a
        collective, as DDP's does)."""
        with self._clock.in_report() as pace:
            self._report(metrics, checkpoint, dir_name, mode, delete_local, upload_fn, pace)
            self._exchange.sent(self.index)
        self.reads.step_done()

    def _report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None, dir_name: str | None,
                mode: CheckpointUploadMode, delete_local: bool, upload_fn: Callable[[Checkpoint, str], Checkpoint] | None,
                pace: Pace) -> None:
        """Apply the report's plans (worker/report/plan.py)."""
        self._resume.check_loaded(self._kept is not None, self._restored_loaded)
        self._loaders.trained()
        self.index += 1
        generation, rank = self.context.assignment.generation, self.context.assignment.rank
        plan = plan_report(checkpoint=checkpoint is not None, in_memory=checkpoint is not None and checkpoint.in_memory,
                           mode=mode, user_upload=upload_fn is not None, named=dir_name is not None,
                           keeps_state=self._kept is not None, live_due=self._storing.live_due(),
                           stores_every=self._setup.checkpointing.stores_every)
        files, live = None, None
        if checkpoint is not None and not plan.waits_commit:
            self._pending = (generation, self.index)  # get_checkpoint() answers it once it is committed
        stepped = self._lockstep.stepped()  # before the report's collectives (a sharded kept state's, the barrier's)
        copy_share = self._shares is not None and self._shares.due(checkpoint is None, self.index, generation)
        if checkpoint is not None:
            taken = take(checkpoint, plan, self.context.storage, self.index, generation, dir_name=dir_name,
                         upload_fn=upload_fn, delete_local=delete_local)
            dir_name, files, live = taken.dir_name, taken.files, taken.live
        elif plan.carries is Carries.KEPT:  # no checkpoint: the state kept live serves a recovery, never stored
            live = self._kept_part(copy_share)
        loader_states = self._loaders.states()
        names = sorted(files) if files is not None else (live.names if live is not None else None)
        facts = facts_soon(files) if files is not None else None  # checked wherever the files are served or stored
        self._loaders.reported(names is not None)
        held = HeldCheckpoint(self.index, generation, rank, names, loader_states) if names is not None else None
        report = Report(generation, self.index, dict(metrics), names, loader_states, dir_name,
                        plan.carries is Carries.LOOP_STORED, plan.sync, pace, plan.store)
        made = MadeReport(report, held, live, stepped)
        if live is not None and live.private:  # a rank's share: held, and sent to its buddy, at once (worker/hold/sharded_state.py)
            self._host.hold(held, live, True, None)
        previous = self._barrier(made, lambda: self._lockstep.confirm(made))
        if plan.goes_on(self._host.unwind_due(self.index) or self._host.grow_due(self.index), previous, pipelines()):
            self._barrier(made, lambda: self._lockstep.go_on(made))
            return
        # A part goes to the buddy inside the report only where every rank waits at its barrier: none went on.
        payload = self._exchange.outgoing(report, files, facts, self.context.assignment.buddy is not None
                                          and all_wait(previous, pipelines()))
        agreed = self._barrier(made, lambda: self._lockstep.agree(made, plan.decides(names), plan.part,
                                                                  plan.carries is Carries.LIVE and bool(plan.store),
                                                                  payload.numel() if payload is not None else 0))
        generation, rank, pipelined = self.context.assignment.generation, self.context.assignment.rank, pipelines()
        report.part_ranks = list(agreed.part_ranks) if agreed.some_part else None
        held = made.held
        after = after_barrier(plan, agreed, previous=previous, pipelined=pipelined,
                              leaving_here=self._leaving_at == self.index, rank=rank)
        if after.drops_kept:
            held = live = report.names = None
        replicate = held is not None and needs_replica(held.names, agreed.every_part)
        if not after.round_trip:  # the supervisor records it in the background
            report.store = after.store
        sent = self._exchange.exchange(agreed, report, payload)  # every rank: it may receive its peer's
        replicate = replicate and not sent
        # No cadence: every rank stores its part of files, as the supervisor would say. A small part
        # went to the buddy above; another is copied there, and the report returns once the buddy or
        # storage holds it (ElasticConfig.part_safe_wait_s).
        upload = PartToStore(generation, self.index, files, facts=facts,
                             replaceable=self._setup.checkpointing.replaceable) if after.uploads_files else None
        if held is not None and not (live is not None and live.private):  # held (and replicated) once agreed
            self._host.hold(held, files if files is not None else live, replicate, facts,
                            upload.safe if upload is not None else None)
        if plan.carries is Carries.LIVE:
            self._storing.live_reported()
        if not after.round_trip:
            waits = upload is not None and not sent and self._setup.part_safe_wait_s > 0
            # Sent at once when the report waits for it to be recorded (`_until_safe`), else in a batch.
            self._host.send_report(report, waits)
            if upload is not None:
                self._storing.store_files(upload)
                if waits:
                    self._until_safe(upload)
            elif after.stores_live:  # every rank holds its live part: rank 0's is stored
                self._storing.live_stored()
                if after.uploads_live:
                    files, facts = self._storing.copy_live(held, live, replicate)
                    self._storing.upload(PartToStore(generation, self.index, files, facts=facts,
                                                     replaceable=self._setup.checkpointing.replaceable))
            elif plan.carries is Carries.LIVE:  # stored if the loop ends here: by rank 0 alone if every rank holds it
                self._storing.skipped(PartToStore(generation, self.index, {}, dir_name=dir_name)
                                       if after.keeps_unstored else None, live)
            if after.unwind:
                self._leave_report()
            return
        self._host.flush_reports(self._setup.settle_timeout_s)  # the reports before this one are recorded first
        reply = self._host.supervisor.report.remote(self.worker_id, report)
        # Made: the next generation resumes from it.
        unwind = self._storing.apply_reply(self.index, reply, held, files, facts, live, replicate)
        if plan.waits_commit:  # Ray's get_checkpoint() answers it from now: as reported (NO_UPLOAD), else stored
            committed = self._storing.wait_committed(self.index)
            self._latest = checkpoint if mode is CheckpointUploadMode.NO_UPLOAD else self._stored(committed)
            self._pending = None  # an older ASYNC one, committed since or not, comes before it
        if after.unwind or (after.together and unwind):
            self._leave_report()

    def _until_safe(self, upload: PartToStore) -> None:
        """Wait until this rank's part is safe beyond its process (copied to the buddy, or stored) and
        its report recorded: a worker lost as its report returns then takes nothing with it, as when
        the supervisor decided (its round trip took that long). At most part_safe_wait_s; 0: no wait."""
        wait_s = self._setup.part_safe_wait_s
        deadline = time.monotonic() + wait_s
        if wait_s and upload.safe.wait(wait_s):
            self._host.flush_reports(max(0.0, deadline - time.monotonic()))

    def _kept_part(self, copy_share: bool) -> LivePart | None:
        """The kept state's part of this report: a replicated model's tensors, held by reference; a
        sharded model's share, copied where every rank agreed to (worker/report/share_copies.py)."""
        if not self._kept.sharded:
            return self._kept.snapshot()
        return self._shares.copy(self._kept.snapshot) if copy_share else None

    def _barrier(self, made: MadeReport, step: Callable[[], T]) -> T:
        """A `step` of the report's barrier (confirm the previous report's, go on, agree). Where it fails
        (a peer lost, or the generation ended under it), the loop goes on in place if it can, and the
        step is made again in the new group, the report then the new generation's."""
        while True:
            try:
                return step()
            except (PeerLost, GenerationEnded):
                if not self.go_on_in_place("report"):
                    raise
                place = self.context.assignment
                made.report.generation = place.generation  # not sent: its barrier had not passed
                if made.held is not None:  # the part held as the old generation's stays that
                    made.held = dataclasses.replace(made.held, generation=place.generation, rank=place.rank)

    def _leave_report(self) -> None:
        """Every rank leaves the group at this report (it re-forms: a peer leaves, or newcomers join):
        the loop goes on in place if the next generation allows, else it unwinds."""
        if not self.go_on_in_place("leave"):
            raise GenerationEnded()

    def reduced(self) -> None:
        """A step's gradients were reduced over the group (worker/group/reduction.py)."""
        index, steps, _ = self._reduced
        self._reduced = (self.index, steps + 1 if index == self.index else 1, collectives_made())
        self._loaders.trained()
        self.reads.step_done()

    @property
    def recovers_in_place(self) -> bool:
        """May the loop go on in place when a peer is lost under it? ElasticConfig.recover_in_place, on
        gloo, unless the loop's model is bound to the world it was built at (`bound_to_world`)."""
        return self._setup.recover_in_place and self._setup.backend == "gloo" and not self._bound_to_world

    def reduces_steps(self) -> None:
        """The loop's DDP reduces each step's gradients through our comm hook: the step is whole at
        `reduced()`. Only then may a failed collective of the loop's own go on in place: otherwise the
        loop may have reduced part of a step's gradients itself (a hand-written average), and the
        batches drawn since the last report may have been applied already."""
        self._reduces_steps = True

    def bound_to_world(self) -> None:
        """The loop's model is bound to the world it was built at: a DDP on a group of its own
        (`prepare_model(..., parallel_strategy_kwargs={"process_group": ...})`) or on the default group
        itself (its collectives cannot follow the loop into a new group, or it divides its gradients by
        the world size it was built at), or sharded with FSDP (each rank holds its share of that
        world). Every recovery re-enters the loop."""
        self._bound_to_world = True

    def generation_ended(self) -> bool:
        """Did the supervisor end the generation the loop is in?"""
        return self._host.generation_ended()

    def go_on_in_place(self, at: str) -> bool:
        """The group must re-form under the loop, which stands `at` (protocol.py `Position`): a
        collective of the step's gradient reduction (worker/group/reduction.py) or one of DDP's own
        (worker/group/ddp.py) failed, the barrier of a report failed, or every rank leaves the group
        at this report. Park inside the loop and go on in the next generation if it re-forms in place. The
        context then answers the new place, and the prepared loaders re-shard the rest of the epoch
        over it, with the shares the lost ranks did not complete. A loop with no prepared loader draws
        its data by what it read of its place: it goes on where none of that changed (a rank that
        keeps its number, the world size never read), which the supervisor weighs with the rest of
        the loop's reads (`reads.relevant`). False: the loop must unwind and is entered afresh."""
        index, steps, calls = self._reduced
        position = Position(self.index, steps if index == self.index else 0, at, collectives_made() - calls)
        if not self.recovers_in_place or position == self._went_on_from:
            return False  # the same collective failed again where the loop went on in place: entered afresh
        if at in ("collective", "rooted") and not self._reduces_steps:
            return False
        self._lockstep.settle_pending()
        place = self._host.reform(position, self.reads.relevant(at))
        if place is None:
            return False
        self._went_on_from = position
        self.context.assignment = place
        self._lockstep.reformed(place.world_size, place.generation)
        self._loaders.reformed(place.rank, place.world_size, place.previous_ranks or ())
        return True

    def finish(self) -> None:
        """The loop returned: its last report counts once every rank made it (raises if one did not)."""
        self._lockstep.finish()

    @property
    def unagreed(self) -> Report | None:
        """A report whose barrier failed, whose live part still counts (worker/report/lockstep.py)."""
        return self._lockstep.unagreed

    def unstored(self) -> PartToStore | None:
        """The newest reported part the cadence skipped, to store as the loop returned (worker/store/storing.py)."""
        return self._storing.unstored()

    def preemption_info(self) -> PreemptionInfo | None:
        """The same answer on every rank (see supervisor/preemption/notices.py)."""
        self._preemption_calls += 1
        info = self._agree_with_supervisor(self._host.supervisor.preemption_info, self._preemption_calls)
        if info is not None:  # the loop saw the notice: the group re-forms after its next report
            self._leaving_at = self.index + 1
            self._host.unwind_at(self._leaving_at)
        return info

    def collective(self, data: Any = None) -> Any:
        """A barrier across the ranks that returns rank 0's `data` (see supervisor/agreement.py)."""
        self._collective_calls += 1
        return self._agree_with_supervisor(self._host.supervisor.collective, self._collective_calls,
                                           data if self.context.assignment.rank == 0 else None)

    def _agree_with_supervisor(self, method: Any, call: int, *brought: Any) -> Any:
        """Call number `call` of a supervisor `method` that every rank makes alike; unwinds the loop
        when the generation ends."""
        if self._host.generation_ended():
            raise GenerationEnded()
        with self._clock.in_barrier():
            accepted, answer = ray.get(method.remote(self.worker_id, self.context.assignment.generation, call,
                                                     self.index, *brought))
        if not accepted:
            raise GenerationEnded()
        return answer

    def get_checkpoint(self) -> Checkpoint | None:
        """As Ray's: the newest checkpoint this rank reported once stored (a SYNC or NO_UPLOAD one as
        its report returns, an ASYNC one once committed), else the one the loop resumes from."""
        if not self._restored_loaded:
            self._restored = self._resume.checkpoint()
            self._restored_loaded = True
        if self._pending is not None:
            committed, _ = self._storing.committed(*self._pending, timeout_s=0.0)
            if committed is not None:
                self._latest, self._pending = self._stored(committed), None
        return self._latest if self._latest is not None else self._restored

    def _stored(self, committed: CommittedCheckpoint) -> Checkpoint:
        storage = self.context.storage
        return Checkpoint(storage.folder(committed.attempt), storage.fs, committed.manifest)

    def reported_checkpoints(self, timeout_s: float | None) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Every committed checkpoint of the run so far (after those this worker reported settle, or
        `timeout_s`, by default store_flush_timeout_s)."""
        self._host.flush_reports(self._setup.settle_timeout_s)  # reports sent in batches are recorded first
        found = ray.get(self._host.supervisor.reported_checkpoints.remote(
            self.context.assignment.generation, self.index,
            self._setup.settle_timeout_s if timeout_s is None else timeout_s))
        return [(self._stored(c), metrics) for c, metrics in found]

    # -- for prepare_model and prepare_data_loader -----------------------------------------------
    def keep_state(self, model: torch.nn.Module) -> None:
        """`prepare_model(model, live_state=True)`: keep `model`'s state (and its optimizers') live for
        recovery; when this generation resumes from such a state, load it into them."""
        if self._kept is not None:
            raise ValueError(
                "prepare_model(..., live_state=True) was called twice in one loop: keep the state of one model "
                "(put several in one torch.nn.Module), or report the others in Checkpoint.from_dict.")
        self._kept = KeptState(model, self._resume.kept_state(model), self._lockstep.commit_step)
        if self._kept.sharded:
            self.bound_to_world()
            self._shares = ShareCopies(self._setup.sharded_state_budget, self._host)

    def keep_object(self, obj: Any) -> None:
        """`elastic_train.torch.keep_state(obj)`: keep `obj`'s state with the model's."""
        if self._kept is None:
            raise ValueError(
                f"keep_state({type(obj).__name__}) keeps an object's state with the model's kept state: call "
                "prepare_model(model, live_state=True) before it. In a loop that reports checkpoints, save its "
                "state_dict() in the checkpoint instead.")
        self._kept.keep(obj)

    def dataset_shard(self, name: str | None) -> Any:
        """`get_dataset_shard(name)` (worker/loop/loaders.py)."""
        return self._loaders.dataset_shard(name, self.context.get_world_rank(), self.context.get_world_size())

    def register_loader(self, loader: StatefulLoader) -> dict[str, Any] | None:
        """Track a prepared loader; returns the position it resumes from, if any."""
        return self._loaders.register(loader)

    @property
    def resumes_kept_state(self) -> bool:
        """The loop resumes from its state kept live: its loaders' positions are all it has of its own."""
        return self._resume.state_only

    def close(self) -> None:
        """The generation is over: finish a report still awaiting its barrier (the loop raised after
        it), and remove what this session wrote to local disk."""
        try:
            self.finish()
        except (PeerLost, GenerationEnded):
            pass  # kept as unagreed if its step made a collective with every peer
        self._resume.close()
        if self._kept is not None:
            self._kept.close()

