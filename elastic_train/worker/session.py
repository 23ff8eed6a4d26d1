"""What the user's loop talks to inside a worker: report, get_checkpoint, get_context.

One `TrainSession` lives per generation. `report()` keeps an in-memory snapshot of the checkpoint
(the state survivors resume from), waits for every rank at a barrier over the process group
(report_barrier.py), tells the supervisor, hands the snapshot to the persister, and unwinds the loop
with `GenerationEnded` when the group is about to be re-formed. A report without a checkpoint does
not wait for the supervisor: its metrics are sent and the loop goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, NoReturn, Protocol

import ray
import torch
import torch.distributed as dist

from elastic_train.checkpoint.checkpoint import (STATE_FILE, Checkpoint, checkpoint_from_files, dict_from_bytes, is_local,
                                                 needs_replica)
from elastic_train.checkpoint.layout import check_named_folder, checkpoint_dirname
from elastic_train.checkpoint.manifest import facts_soon, file_problem
from elastic_train.checkpoint.modes import CheckpointUploadMode
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import CheckpointConfig
from elastic_train.errors import CheckpointError, CorruptCopy, GenerationEnded, PeerLost
from elastic_train.protocol import HeldCheckpoint, Pace, PreemptionInfo, Report, ReportReply, ResumePlan
from elastic_train.worker.context import TrainContext
from elastic_train.worker.kept_state import KeptState
from elastic_train.worker.live_part import LivePart
from elastic_train.worker.memory import Part
from elastic_train.worker.resident import resident_bytes
from elastic_train.worker.persister import PartUpload
from elastic_train.worker.report_barrier import (Agreed, Agreement, agree, all_wait, collectives_done, goes_on, issue,
                                                 pipelines)
from elastic_train.worker.state_transfer import share

logger = logging.getLogger(__name__)

UPLOAD_WAIT_NOTED_S = 0.01  # a report that waited longer than this for room in the upload queue is an event




class StatefulLoader(Protocol):
    def loader_state(self) -> dict[str, Any]: ...


class _Pending:
    """A plain report that went on before its barrier passed. Its report goes to the supervisor once
    the barrier passed, from the thread that completes it: a peer whose round trip waits for every
    rank's report is not held a step. Sent once, before any later report of this rank."""

    def __init__(self, agreement: Agreement, held: HeldCheckpoint | None, live: LivePart | None, report: Report,
                 stepped: bool, send: Callable[[Report, bool], None]):
        self.agreement, self.held, self.live, self.report, self.stepped = agreement, held, live, report, stepped
        self._send = send
        self._sent = False
        self._lock = threading.Lock()

    def send(self, agreed: Agreed) -> None:
        with self._lock:
            if self._sent:
                return
            self._sent = True
            if agreed.some_part:  # a peer reports a checkpoint: the run resumes from that, not a kept state
                self.report.names = None
            self._send(self.report, agreed.round_trip)


class TrainSession:
    def __init__(
        self,
        worker_id: int,
        supervisor: Any,
        context: TrainContext,
        keep: Callable[[HeldCheckpoint, Part, bool, Future | None], None],  # (held, part, copy it to the buddy, its facts)
        read_held: Callable[[int, int, list[str]], dict[str, bytes]],
        held_state: Callable[[int, int], dict[str, Any] | None],  # CheckpointMemory.live_state
        persist: Callable[[PartUpload], float | None],
        send_report: Callable[[Report, bool], None],  # (report, urgent: a peer's round trip waits for it)
        flush_reports: Callable[[float], bool],
        generation_ended: Callable[[], bool],
        unwind_due: Callable[[int], bool],
        unwind_at: Callable[[int], None],
        storage: RunStorage,
        checkpointing: CheckpointConfig,
        settle_timeout_s: float,
        initial_checkpoint: Checkpoint | None = None,
    ):
        self.worker_id = worker_id
        self.context = context
        self._supervisor = supervisor
        self._keep = keep
        self._read_held = read_held
        self._held_state = held_state
        self._persist = persist
        self._send_report = send_report  # a report that needs no reply, sent in the background (report_sender.py)
        self._flush_reports = flush_reports
        self._generation_ended = generation_ended
        self._unwind_due = unwind_due  # was this worker asked to leave the loop at report `index`?
        self._unwind_at = unwind_at  # leave it at report `index` (or the first after)
        self._storage = storage
        self._checkpointing = checkpointing
        self._live_reports, self._live_stored_at = 0, time.monotonic()  # live parts reported since one was stored
        self._settle_timeout_s = settle_timeout_s  # how long SYNC / NO_UPLOAD reports wait for their commit
        self._initial_checkpoint = initial_checkpoint  # resume_from_checkpoint: while the run has none of its own
        self._unpersisted: tuple[PartUpload, LivePart | None] | None = None  # the newest part the cadence skipped
        self.unagreed: Report | None = None  # a report whose barrier failed, whose live part still counts
        self._collectives_seen = collectives_done()  # the group's collectives up to the last barrier passed
        self._agreed: Agreed | None = None  # the last report's agreement, which every rank knows by now
        self._pending: _Pending | None = None  # a plain report that went on, its agreement in flight
        self._leaving_at: int | None = None  # the report after which every rank leaves, told alike (preemption_info)
        resume = context.assignment.resume
        self.index = resume.index if resume else 0
        self._resume_states = list(resume.loader_states) if resume else []
        self._loaders: list[StatefulLoader] = []
        self._kept: KeptState | None = None  # prepare_model(model, live_state=True)
        self._step_committed = False  # NCCL: the kept state's step since the last barrier was agreed (_commit_step)
        self._restored: Checkpoint | None = None
        self._restored_loaded = False
        self._scratch: str | None = None
        self._preemption_calls = 0
        self._collective_calls = 0
        self._step_s = 0.0  # the loop's time since the last report, outside report() and other barriers
        self._outside_since = time.monotonic()
        self._stall_s = 0.0  # how long the last report() held the loop

    # -- the user's API -------------------------------------------------------------------------
    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None, *,
               dir_name: str | None = None, mode: CheckpointUploadMode = CheckpointUploadMode.ASYNC, delete_local: bool = False,
               upload_fn: Callable[[Checkpoint, str], Checkpoint] | None = None) -> None:
        """Snapshot the checkpoint, wait for every rank, tell the supervisor, hand the part to the
        persister; return once every rank has made this report (and, for SYNC and NO_UPLOAD, once the
        checkpoint is committed). `report()` is a barrier, as in Ray Train: no rank runs a step ahead
        of a lost peer's last report, even in a loop with no collective, so at most one step is
        redone; and the newest checkpoint every rank reported is the oldest this worker may still
        need, never evicted by the snapshot kept here. A dict checkpoint is held as the live tensors
        it names (live_part.py), serialized only to be stored.

        Where we differ: a report with no checkpoint after one with none (report_barrier.py `goes_on`)
        returns before the other ranks made it, its barrier awaited by the next report (or as the loop
        ends); its metrics go to the supervisor in the background once every rank made it. It costs
        ~0.2 ms; a rank runs at most one step ahead of the others (none in a loop whose step makes a
        collective, as DDP's does)."""
        pace = Pace(self._enter_barrier(), resident_bytes(), self._stall_s)
        self._step_s = 0.0
        entered = time.monotonic()
        try:
            self._report(metrics, checkpoint, dir_name, mode, delete_local, upload_fn, pace)
        finally:
            self._outside_since = time.monotonic()
            self._stall_s = self._outside_since - entered

    def _report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None, dir_name: str | None,
                mode: CheckpointUploadMode, delete_local: bool, upload_fn: Callable[[Checkpoint, str], Checkpoint] | None,
                pace: Pace) -> None:
        self._check_resumed()
        self.index += 1
        assignment = self.context.assignment
        files: dict[str, bytes] | None = None
        live: LivePart | None = None
        registered = False
        if checkpoint is not None:
            if dir_name is not None:
                check_named_folder(dir_name, self.index, assignment.generation)
            if upload_fn is not None:  # the user's upload, into the run's folder; then registered as stored
                dir_name = dir_name or checkpoint_dirname(self.index, assignment.generation)
                checkpoint, mode = upload_fn(checkpoint, dir_name), CheckpointUploadMode.NO_UPLOAD
            if mode is CheckpointUploadMode.NO_UPLOAD:
                dir_name, registered = self._storage.name_of(checkpoint.path), True
                check_named_folder(dir_name, self.index, assignment.generation)
            else:
                if self._overlap(checkpoint) == "holds the run":
                    raise CheckpointError(
                        f"report(checkpoint=Checkpoint.from_directory({checkpoint.path!r})): that folder holds the "
                        "run's own folder (get_context().get_trial_dir()), its record and its other checkpoints. "
                        "Save into a folder of its own, e.g. tempfile.TemporaryDirectory(), and report that.")
                if checkpoint.in_memory and mode is CheckpointUploadMode.ASYNC:
                    live = LivePart.of(checkpoint)
                else:
                    files = checkpoint.files()
                if delete_local:
                    self._delete_local(checkpoint)
        elif self._kept is not None:  # no checkpoint: the state kept live serves a recovery, never stored
            live = self._kept.snapshot()
        kept = live is not None and live.state_only
        loader_states = [loader.loader_state() for loader in self._loaders]
        names = sorted(files) if files is not None else (live.names if live is not None else None)
        facts = facts_soon(files) if files is not None else None  # checked wherever the files are served or stored
        held = HeldCheckpoint(self.index, assignment.generation, assignment.rank, names, loader_states) if names is not None else None
        stored = live is not None and not kept  # a live part that the cadence may store
        store = None if live is None else stored and self._checkpointing.persist_due(
            self._live_reports + 1, time.monotonic() - self._live_stored_at)
        report = Report(assignment.generation, self.index, dict(metrics), names, loader_states, dir_name, registered,
                        mode is CheckpointUploadMode.SYNC, pace, store)
        # The supervisor decides on a checkpoint's storage, except for a live dict part (unless named).
        decide = checkpoint is not None and (live is None or dir_name is not None)
        stepped = self._stepped()
        previous, pipelined = self._confirm(held, live, report, stepped), pipelines()
        if goes_on(checkpoint is None, self._unwind_due(self.index), previous, pipelined):
            self._go_on(held, live, report, stepped)
            return
        agreed = self._agree(decide, held is not None and not kept, held, live, report, bool(store), stepped)
        if not (together := all_wait(previous, pipelined, self._leaving_at == self.index)):
            # Peers may have gone on: they unwind with this rank after the next report, where all wait.
            agreed = dataclasses.replace(agreed, unwind=False)
        if kept and agreed.some_part:  # a peer reports a checkpoint: the run resumes from that, not the kept state
            held = live = report.names = None
        replicate = held is not None and needs_replica(held.names, agreed.every_part)
        if held is not None and (files is not None or live is not None):  # held (and replicated) once agreed
            self._keep(held, files if files is not None else live, replicate, facts)
        if stored:
            self._live_reports += 1
        if not agreed.round_trip:  # the supervisor records it in the background
            if stored:
                report.store = agreed.store_live
            self._send_report(report, False)
            if live is not None and agreed.store_live:  # every rank holds its live part: rank 0's is stored
                self._live_reports, self._live_stored_at, self._unpersisted = 0, time.monotonic(), None
                if assignment.rank == 0:
                    files, facts = self._copy_live(held, live, replicate)
                    self._upload(PartUpload(assignment.generation, self.index, files, facts=facts,
                                            replaceable=self._checkpointing.replaceable))
            elif stored:  # stored if the loop ends here: by rank 0 alone if every rank holds it
                keeps = assignment.rank == 0 or not agreed.every_part
                self._unpersisted = (PartUpload(assignment.generation, self.index, {}, dir_name=dir_name), live) \
                    if keeps else None
            if agreed.unwind:
                raise GenerationEnded()
            return
        self._flush_reports(self._settle_timeout_s)  # the reports before this one are recorded first
        reply = self._supervisor.report.remote(self.worker_id, report)
        unwind = self._settle(self.index, reply, held, files, facts, live, replicate)  # made: the next generation resumes from it
        unwind = unwind and together
        if checkpoint is not None and mode is not CheckpointUploadMode.ASYNC:
            self._wait_committed(self.index)
        if unwind or agreed.unwind:
            raise GenerationEnded()

    def _stepped(self) -> bool:
        """Did the step since the last report make a collective with every peer (see `_keep_unagreed`)?"""
        if dist.is_initialized() and dist.get_backend() == "nccl":  # issued is not done: only a committed step counts
            stepped, self._step_committed = self._step_committed, False
        else:
            done, seen = collectives_done(), self._collectives_seen
            stepped = done is not None and seen is not None and done > seen
        return stepped or self.context.get_world_size() == 1

    def _agree(self, checkpoint: bool, part: bool, held: HeldCheckpoint | None, live: LivePart | None,
               report: Report, store_live: bool, stepped: bool) -> Agreed:
        """The report's barrier (report_barrier.py), waited for; unwinds the loop when it fails."""
        self._check_ended(held, live, report, stepped)
        try:
            agreed = agree(checkpoint, self._unwind_due(self.index), part, store_live)
        except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
            self._barrier_failed(exc, report.index, held, live, report, stepped)
        self._agreed, self._collectives_seen = agreed, collectives_done()
        return agreed

    def _go_on(self, held: HeldCheckpoint | None, live: LivePart | None, report: Report, stepped: bool) -> None:
        """A plain report leaves before its barrier passed: the next report (or the loop's end) awaits it."""
        self._check_ended(held, live, report, stepped)
        agreement = issue(False, False, False, False)
        self._collectives_seen = collectives_done()
        self._pending = _Pending(agreement, held, live, report, stepped, self._send_report)
        agreement.on_passed(self._pending.send)

    def _confirm(self, held: HeldCheckpoint | None, live: LivePart | None, report: Report, stepped: bool) -> Agreed | None:
        """The previous report's agreement, awaited if that report went on without it; its kept state
        is then held. If it failed, the report being made (`held`, `live`, `report`) is the one whose
        barrier failed: this rank's step since made a collective with every peer if `stepped`."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                self._agreed = pending.agreement.result()
            except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
                self._barrier_failed(exc, pending.report.index, held, live, report, stepped)
            pending.send(self._agreed)
            if pending.held is not None and pending.live is not None and pending.report.names is not None:
                self._keep(pending.held, pending.live, False, None)
        return self._agreed

    def finish(self) -> None:
        """The loop returned: its last report counts once every rank made it (raises if one did not)."""
        pending = self._pending
        if pending is not None:
            self._confirm(pending.held, pending.live, pending.report, pending.stepped)

    def _check_ended(self, held: HeldCheckpoint | None, live: LivePart | None, report: Report, stepped: bool) -> None:
        if self._generation_ended():
            self._keep_unagreed(held, live, report, stepped)
            raise GenerationEnded()

    def _barrier_failed(self, exc: Exception, index: int, held: HeldCheckpoint | None, live: LivePart | None,
                        report: Report, stepped: bool) -> NoReturn:
        self._keep_unagreed(held, live, report, stepped)
        if self._generation_ended():
            raise GenerationEnded() from exc
        raise PeerLost(f"report {index}'s barrier failed: {exc}") from exc

    def _check_resumed(self) -> None:
        """A loop whose state is kept live that resumed from a checkpoint it reported (the newest there
        was) must have loaded it: its kept state was not restored, and going on from a fresh model at
        the checkpoint's data position would train a wrong model without a word."""
        plan = self.context.assignment.resume
        if self._kept is None or plan is None or plan.state_only or self._restored_loaded:
            return
        raise CheckpointError(
            f"this generation resumed from checkpoint {plan.index}, the newest the loop reported, but the loop did not "
            "load it (get_checkpoint()) before its first report: prepare_model(live_state=True) restores only the state "
            "kept at reports without a checkpoint. Load get_checkpoint() in the loop, as Ray Train's guides do, or "
            "report no checkpoint in a loop whose state is kept live (return the final state instead).")

    def _keep_unagreed(self, held: HeldCheckpoint | None, live: LivePart | None, report: Report,
                       stepped: bool) -> None:
        """The report's barrier did not pass, so some rank may not have made this report. Its live dict
        part still counts if the step before it made a collective (DDP's gradient all-reduce) with
        every peer: each rank's share of the step is then in the state held. That state is the
        freshest there is: the previous report's live part holds the same tensors, moved on since. The
        supervisor hears of it when this worker parks, and may resume the next generation from it."""
        if held is not None and live is not None and stepped:
            self._keep(held, live, False, None)
            self.unagreed = report

    def preemption_info(self) -> PreemptionInfo | None:
        """The same answer on every rank (see supervisor/notices.py)."""
        self._preemption_calls += 1
        info = self._agree_with_supervisor(self._supervisor.preemption_info, self._preemption_calls)
        if info is not None:  # the loop saw the notice: the group re-forms after its next report
            self._leaving_at = self.index + 1
            self._unwind_at(self._leaving_at)
        return info

    def collective(self, data: Any = None) -> Any:
        """A barrier across the ranks that returns rank 0's `data` (see supervisor/agreement.py)."""
        self._collective_calls += 1
        return self._agree_with_supervisor(self._supervisor.collective, self._collective_calls,
                                           data if self.context.assignment.rank == 0 else None)

    def _agree_with_supervisor(self, method: Any, call: int, *brought: Any) -> Any:
        """Call number `call` of a supervisor `method` that every rank makes alike; unwinds the loop
        when the generation ends."""
        if self._generation_ended():
            raise GenerationEnded()
        self._step_s = self._enter_barrier()
        try:
            accepted, answer = ray.get(method.remote(self.worker_id, self.context.assignment.generation, call,
                                                     self.index, *brought))
        finally:
            self._outside_since = time.monotonic()
        if not accepted:
            raise GenerationEnded()
        return answer

    def get_checkpoint(self) -> Checkpoint | None:
        if not self._restored_loaded:
            self._restored = self._load_resume_checkpoint()
            self._restored_loaded = True
        return self._restored

    # -- for prepare_model and prepare_data_loader -----------------------------------------------
    def keep_state(self, model: torch.nn.Module) -> None:
        """`prepare_model(model, live_state=True)`: keep `model`'s state (and its optimizers') live for
        recovery; when this generation resumes from such a state, load it into them."""
        if self._kept is not None:
            raise ValueError(
                "prepare_model(..., live_state=True) was called twice in one loop: keep the state of one model "
                "(put several in one torch.nn.Module), or report the others in Checkpoint.from_dict.")
        self._kept = KeptState(model, self._restored_state(), self._commit_step)

    def keep_object(self, obj: Any) -> None:
        """`elastic_train.torch.keep_state(obj)`: keep `obj`'s state with the model's."""
        if self._kept is None:
            raise ValueError(
                f"keep_state({type(obj).__name__}) keeps an object's state with the model's kept state: call "
                "prepare_model(model, live_state=True) before it. In a loop that reports checkpoints, save its "
                "state_dict() in the checkpoint instead.")
        self._kept.keep(obj)

    def _commit_step(self) -> None:
        """Before the kept state's optimizer steps, under NCCL: there the step's gradient all-reduce runs
        on the GPU after the loop has moved on, and the optimizer's kernels would apply whatever a failed
        one left in the gradients. As torchft does, every rank agrees first: a one-element all-reduce
        after the gradients', on the same communicator, read here. It adds up to the world size only if
        every rank's gradients came through; otherwise the step is not taken and the loop unwinds, its
        state still the last report's."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        ones = torch.ones(1, dtype=torch.int32, device=torch.device("cuda", torch.cuda.current_device()))
        try:
            dist.all_reduce(ones)
            agreed = int(ones.item()) == dist.get_world_size()
        except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
            raise PeerLost(f"the step's commit before optimizer.step() failed: {exc}") from exc
        if not agreed or self._generation_ended():
            raise PeerLost("a peer was lost during the step's gradient all-reduce: the step is not taken")
        self._step_committed = True

    def _restored_state(self) -> dict[str, Any] | None:
        """The kept state this generation resumes from. A survivor has its own tensors (every rank's
        kept state is the same; none is serialized), or a copy a leaving peer handed it. A newcomer
        receives it from a survivor over the group (state_transfer.py), and holds it, the supervisor
        told before it goes on, until its first report: a survivor lost before then does not take the
        only copy with it. Over Ray only where no member holds it."""
        plan = self.context.assignment.resume
        if plan is None or not plan.state_only:
            return None
        own = self._held_state(plan.generation, plan.index)
        if own is None:
            try:
                own = dict_from_bytes(self._read_held(plan.generation, plan.index, [STATE_FILE])[STATE_FILE])
            except KeyError:
                pass
        state = share(own) if dist.is_initialized() and dist.get_world_size() > 1 else own
        if state is None:
            state = dict_from_bytes(self._gather(plan)[STATE_FILE])
        if own is None:
            held = HeldCheckpoint(plan.index, plan.generation, -1, [STATE_FILE], plan.loader_states)
            self._keep(held, LivePart(state, file=STATE_FILE), False, None)
            ray.get(self._supervisor.replica_held.remote(self.worker_id, plan.generation, plan.index, [STATE_FILE]))
        # Copies of the optimizers' tensors: the optimizer would take them as its own and write them,
        # and the held state must stay as reported while it may still serve a recovery.
        return {"model": state["model"], "optimizers": copy.deepcopy(state["optimizers"]), "objects": state["objects"]}

    def register_loader(self, loader: StatefulLoader) -> dict[str, Any] | None:
        """Track a prepared loader; returns the position it resumes from, if any."""
        position = len(self._loaders)
        self._loaders.append(loader)
        return self._resume_states[position] if position < len(self._resume_states) else None

    # -- internals ------------------------------------------------------------------------------
    def _enter_barrier(self) -> float:
        """The loop's time since the last report, outside barriers, as it enters one (its step time,
        for telling stragglers: supervisor/pace.py)."""
        return self._step_s + time.monotonic() - self._outside_since

    def _settle(self, index: int, reply_ref: Any, held: HeldCheckpoint | None, files: dict[str, bytes] | None,
                facts: Future[dict[str, dict[str, Any]]] | None, live: LivePart | None, replicate: bool) -> bool:
        """Act on the supervisor's reply to report `index`; returns whether the group re-forms after it."""
        reply: ReportReply = ray.get(reply_ref)
        if not reply.accepted:
            logger.warning("report %d rejected: this worker was fenced out of generation %d",
                           index, self.context.assignment.generation)
            raise GenerationEnded()
        if reply.list_stored:  # a checkpoint the loop stored itself: listed here, then committed
            facts = self._storage.stored_facts(reply.dir_name)
            ray.get(self._supervisor.part_persisted.remote(self.worker_id, self.context.assignment.generation, index,
                                                           facts))
        if held is not None and (files is not None or live is not None):
            if reply.persist and live is not None:
                files, facts = self._copy_live(held, live, replicate)
                self._live_reports, self._live_stored_at = 0, time.monotonic()
            part = PartUpload(self.context.assignment.generation, index, files or {}, replaceable=reply.replaceable,
                              dir_name=reply.dir_name, facts=facts)
            self._unpersisted = None if reply.persist else (part, live)
            if reply.upload:
                self._upload(part)
        return reply.unwind

    def _copy_live(self, held: HeldCheckpoint, live: LivePart,
                   replicate: bool) -> tuple[dict[str, bytes], Future[dict[str, dict[str, Any]]]]:
        """The consistent copy of a live part to store, and its files' facts (on their way), taken
        while the loop waits in report(); held in its place."""
        files = live.files()
        if files is None:
            raise CheckpointError(
                f"the tensors of report {held.index}'s Checkpoint.from_dict were written to while report() "
                "stored them (by another thread of the loop?): report a dict of copies "
                "({k: v.clone() ...}) if the loop must go on writing them.")
        facts = facts_soon(files)
        self._keep(held, files, replicate, facts)
        return files, facts

    def _upload(self, part: PartUpload) -> None:
        """Hand a part to the persister (it waits for room in the upload queue)."""
        waited = self._persist(part)
        if waited is None:  # the generation ended while the report waited for upload room
            raise GenerationEnded()
        if waited > UPLOAD_WAIT_NOTED_S:
            self._supervisor.upload_waited.remote(self.worker_id, part.index, waited)

    def unpersisted(self) -> PartUpload | None:
        """The newest reported part, when the cadence skipped it (the loop returned: it is stored now);
        None if there is none, or a live one was written to since its report."""
        if self._unpersisted is None:
            return None
        part, live = self._unpersisted
        if live is not None:
            files = live.files()
            if files is None:
                logger.warning("the last checkpoint (report %d) was written to after its report: not stored", part.index)
                return None
            part.files = files
        return part

    def _wait_committed(self, index: int) -> None:
        """SYNC / NO_UPLOAD: return once checkpoint `index` is committed in storage."""
        generation = self.context.assignment.generation
        committed, over = ray.get(self._supervisor.checkpoint_settled.remote(generation, index,
                                                                            self._settle_timeout_s))
        if committed is not None:
            return
        if over or self._generation_ended():  # a peer was lost before storing its part: the group re-forms
            raise GenerationEnded()
        raise CheckpointError(
            f"the checkpoint of report {index} was not committed to {self._storage.url()} within "
            f"persist_flush_timeout_s={self._settle_timeout_s}s (storage kept failing, or a part was given up); "
            "see the run's events.")

    def _delete_local(self, checkpoint: Checkpoint) -> None:
        """`delete_local_checkpoint_after_upload`: remove the reported local folder once it is held in
        memory. Never a folder in the run's storage, nor one holding it."""
        if checkpoint.manifest is not None or not checkpoint.path or not is_local(checkpoint.filesystem):
            return
        if self._overlap(checkpoint) is not None:
            logger.warning("not deleting %s after the report: it is in the run's storage", checkpoint.path)
            return
        shutil.rmtree(os.path.realpath(checkpoint.path), ignore_errors=True)

    def _overlap(self, checkpoint: Checkpoint) -> str | None:
        """How a reported local folder overlaps the run's local folder: "holds the run" (it is that
        folder, or one above it), "in the run", or None."""
        if not checkpoint.path or not is_local(checkpoint.filesystem) or not is_local(self._storage.fs):
            return None
        folder, run = os.path.realpath(checkpoint.path), os.path.realpath(self._storage.url())
        if folder == run or run.startswith(folder + os.sep):
            return "holds the run"
        return "in the run" if folder.startswith(run + os.sep) else None

    def reported_checkpoints(self, timeout_s: float | None) -> list[tuple[Checkpoint, dict[str, Any]]]:
        """Every committed checkpoint of the run so far (after those this worker reported settle, or
        `timeout_s`, by default persist_flush_timeout_s)."""
        generation = self.context.assignment.generation
        found = ray.get(self._supervisor.reported_checkpoints.remote(
            generation, self.index, self._settle_timeout_s if timeout_s is None else timeout_s))
        return [(Checkpoint(self._storage.folder(c.attempt), self._storage.fs, c.manifest), metrics)
                for c, metrics in found]

    def _load_resume_checkpoint(self) -> Checkpoint | None:
        plan = self.context.assignment.resume
        if plan is None:
            return self._initial_checkpoint
        if plan.state_only:  # restored into the model by prepare_model: nothing for the loop to load
            return None
        files = self._storage.read_verified(plan.stored) if plan.stored is not None else self._gather(plan)
        self._scratch = tempfile.mkdtemp(prefix="elastic_train_session_")
        return checkpoint_from_files(files, self._scratch)

    def _gather(self, plan: ResumePlan) -> dict[str, bytes]:
        """The checkpoint's files from the memory of the survivors that hold them (this one included),
        each checked against the facts it was reported with. A holder lost meanwhile ends the
        generation (the next one resumes from what is left), as a lost peer does: it is no error of
        the loop's. So does a copy that is not what was reported (`_check_served`)."""
        remote = [holder for holder in plan.holders if holder != self.worker_id]
        refs = [self.context.assignment.peers[holder].read_checkpoint.remote(plan.generation, plan.index,
                                                                             plan.holders[holder])
                for holder in remote]
        served: dict[int, dict[str, bytes]] = {}
        if self.worker_id in plan.holders:
            served[self.worker_id] = self._read_held(plan.generation, plan.index, plan.holders[self.worker_id])
        try:
            served.update(zip(remote, ray.get(refs)))
        except ray.exceptions.RayActorError as exc:
            raise PeerLost(f"a worker holding checkpoint {plan.index} was lost while this one fetched it: {exc}") from exc
        files: dict[str, bytes] = {}
        for holder, part in served.items():
            self._check_served(plan, holder, part)
            files.update(part)
        return files

    def _check_served(self, plan: ResumePlan, holder: int, part: dict[str, bytes]) -> None:
        """Is each file `holder` served what its report made? One that is not (memory corrupted, a
        file served under another's name) is never loaded: the supervisor hears of it, drops that
        copy, and ends the generation; the next one resumes from another copy, storage or an older
        checkpoint (the `checkpoint_copy_corrupt` event)."""
        for name in sorted(part):
            expected = plan.facts.get(name)
            if expected is None:
                logger.warning("%s of checkpoint %d, served from worker %d's memory, has no facts to check it against",
                               name, plan.index, holder)
                continue
            problem = file_problem(name, part[name], expected, "its report")
            if problem is not None:
                logger.error("checkpoint %d served from worker %d's memory is corrupt: %s", plan.index, holder, problem)
                ray.get(self._supervisor.copy_corrupt.remote(self.worker_id, self.context.assignment.generation,
                                                             plan.generation, plan.index, holder, name, problem))
                raise CorruptCopy(f"checkpoint {plan.index} served from worker {holder}'s memory is corrupt: {problem}")

    def close(self) -> None:
        """The generation is over: settle a report still awaiting its barrier (the loop raised after
        it), and remove what this session wrote to local disk."""
        try:
            self.finish()
        except (PeerLost, GenerationEnded):
            pass  # kept as unagreed if its step made a collective with every peer
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        if self._kept is not None:
            self._kept.close()


_current: TrainSession | None = None
_session_hooks: list[Callable[[TrainSession], None]] = []


def on_session_start(hook: Callable[[TrainSession], None]) -> None:
    """Call `hook(session)` whenever a generation's session starts in this process, before the loop
    runs: a framework that keeps the world in process-wide state (Accelerate's `PartialState`)
    resets it there, since a survivor's process outlives its generation."""
    if hook not in _session_hooks:
        _session_hooks.append(hook)


def set_session(session: TrainSession | None) -> None:
    global _current
    _current = session
    if session is not None:
        for hook in list(_session_hooks):
            hook(session)


def current_session() -> TrainSession | None:
    """The running generation's session, or None outside a worker's loop."""
    return _current


def get_session(caller: str) -> TrainSession:
    if _current is None:
        raise RuntimeError(
            f"elastic_train.{caller}() works only inside train_loop_per_worker, run by TorchTrainer.fit()."
        )
    return _current
