"""`Member`: what a worker does, inside its Ray actor (actor.py): it runs the user's loop, generation
after generation.

The process survives membership changes: between generations it parks at the supervisor, is
handed its next place (rank, world size, rendezvous, where to resume from), rebuilds the process
group and re-enters the loop. Only a `Stop` ends it.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import Any

import ray
import torch.distributed as dist

from elastic_train.errors import GenerationEnded, PeerLost
from elastic_train.faithful.reads import track_environment
from elastic_train.protocol import Assignment, Exit, HeldCheckpoint, Outcome, PlaceRead, Position, Stop, WorkerInfo
from elastic_train.run_spec import WorkerSpec
from elastic_train.worker.group.generation import GenerationGroup
from elastic_train.worker.group.process_state import Place, reset_for_generation
from elastic_train.worker.heartbeat import HeartbeatSender
from elastic_train.worker.hold.allocator import retain_freed_memory
from elastic_train.worker.hold.holdings import Holdings
from elastic_train.worker.hold.parts import Part
from elastic_train.worker.hold.replicator import Facts, as_pieces, from_pieces
from elastic_train.worker.loop.context import TrainContext
from elastic_train.worker.loop.current import set_session
from elastic_train.worker.loop.host import SessionSetup
from elastic_train.worker.loop.resume import part_to_store
from elastic_train.worker.loop.session import TrainSession
from elastic_train.worker.preemption import NoticeWatcher, make_pollers
from elastic_train.worker.report.sender import ReportSender, Sent
from elastic_train.worker.store.queue import PartToStore
from elastic_train.worker.store.worker_store import WorkerStore
from elastic_train.worker.warmup import warm_up

logger = logging.getLogger(__name__)


class Member:
    def __init__(self, worker_id: int, supervisor: Any, spec: WorkerSpec):
        self.worker_id = worker_id
        self._supervisor = supervisor
        self._spec = spec
        self._loop = spec.open_loop()
        track_environment()  # the loop's reads of RANK, WORLD_SIZE, ... (faithful/reads.py)
        if spec.elastic.snapshot_memory_retain_mb is not None:
            retain_freed_memory(spec.elastic.snapshot_memory_retain_mb)
        self._held = Holdings(spec.elastic.checkpoints_in_memory, self._send_replica)
        self._reports = ReportSender(self._send_reports, spec.elastic.report_interval_s)
        self._node_id, self._ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        self._group = GenerationGroup(
            spec.backend, spec.elastic.rendezvous_timeout_s, spec.elastic.collective_timeout_s,
            spec.elastic.process_group_destroy_timeout_s, spec.elastic.recover_in_place, self._ip,
        )
        self._generation: int | None = None
        # (generation, report index, grow): leave the group there (grow: at the first report from there that
        # carries a checkpoint)
        self._unwind_at: tuple[int, int, bool] | None = None
        self._assignment: Assignment | None = None  # the last generation's place
        self._place: Place | None = None  # (rank, world size) in the last generation whose loop ran here
        self._session: TrainSession | None = None  # the last generation's session
        self._next: Assignment | Stop | None = None  # given while parked inside the loop, which then unwound
        self._stopped = threading.Event()
        self._ended = threading.Event()
        self._store = WorkerStore(worker_id, supervisor, spec.storage, spec.elastic, self._reports.submit,
                                  self._reports.flush, lambda: self._assignment)
        elastic = spec.elastic
        self._notices = NoticeWatcher(
            self._on_preemption_notice,
            make_pollers(elastic.preemption_pollers, elastic.preemption_metadata_url),
            elastic.preemption_poll_interval_s,
            elastic.preemption_sigterm,
            elastic.preemption_sigterm_grace_s,
        )
        # Awaited: the supervisor must know this worker's address before it parks (calls from two threads
        # of one process are not ordered).
        if ray.get(supervisor.worker_started.remote(worker_id, self._node_id, self._ip, os.getpid())):
            # before it can be given a place: its peers would wait for it
            warm_up(use_cuda=spec.backend == "nccl", datasets=spec.with_datasets)
        # From here on: a worker whose `run` never comes (its supervisor died first) learns it, and ends.
        self._heartbeat = HeartbeatSender(
            supervisor, worker_id, self._node_id, elastic.heartbeat_interval_s, elastic.heartbeat_reply_timeout_s,
            lambda: self._generation, self._report_index, self._on_generation_ended, self._on_supervisor_gone)
        self._heartbeat.start()

    # -- called by peers and the supervisor ---------------------------------------------------
    def ping(self) -> int:
        return os.getpid()

    def end_generation(self, generation: int) -> None:
        """The supervisor ends `generation`: fail its collectives so the loop unwinds."""
        self._on_generation_ended(generation)

    def unwind_at(self, generation: int, index: int, grow: bool = False) -> None:
        """The supervisor re-forms the group: leave `generation`'s group at the first report numbered
        `index` or later (`grow`: newcomers join, at the first such report that carries a checkpoint).
        Every rank learns it at its own time; report()'s barrier makes them leave after the same report."""
        at = self._unwind_at
        if at is None or at[0] != generation:
            self._unwind_at = (generation, index, grow)
        else:  # a peer leaving is not put off until a checkpoint
            self._unwind_at = (generation, min(index, at[1]), grow and at[2])

    def _report_index(self, generation: int | None) -> int:
        """The newest report the loop entered in `generation` (-1: not in it, or its session not begun)."""
        session = self._session
        if generation is None or session is None or session.context.assignment.generation != generation:
            return -1
        return session.index

    def _unwind_due(self, generation: int, index: int, grow: bool = False) -> bool:
        at = self._unwind_at
        return at is not None and at[0] == generation and index >= at[1] and at[2] == grow

    def _on_preemption_notice(self, source: str, seconds_left: float | None) -> None:
        self._supervisor.preemption_notice.remote(self.worker_id, source, seconds_left)

    def read_checkpoint(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Files of checkpoint `index` of `generation`, from this worker's own part or from the replica
        it keeps for a peer."""
        return self._held.read(generation, index, names)

    def hold_replica(self, held: HeldCheckpoint, files: dict[str, bytes] | None, *pieces: tuple[str, bytes]) -> None:
        """Keep a peer's checkpoint part (with the facts it was reported with), and tell the
        supervisor this worker holds it. A small part comes in `pieces` (worker/hold/replicator.py `as_pieces`)."""
        files = files if files is not None else from_pieces(pieces)
        running = held.generation == self._generation
        self._held.hold_replica(held, files, running)
        self._supervisor.replica_held.remote(self.worker_id, held.generation, held.index, held.names, not running,
                                             held.facts)

    def hand_over(self, generation: int, index: int, names: list[str], peer: Any) -> None:
        """This worker is leaving (a preemption notice): copy its files of a checkpoint into `peer`'s
        memory, which then serves them to the next generation."""
        files = self.read_checkpoint(generation, index, names)
        held = HeldCheckpoint(index, generation, -1, sorted(files), [], self._held.facts(generation, index, files))
        ray.get(peer.hold_replica.remote(held, files), timeout=self._spec.elastic.drain_timeout_s)

    def describe(self) -> WorkerInfo:
        """Where this worker stands, for a restarted supervisor to adopt it."""
        place, session = self._assignment, self._session
        group = ray.util.get_current_placement_group()  # its bundle's, unless it is a spare that took one over
        return WorkerInfo(
            worker_id=self.worker_id,
            node_id=self._node_id,
            ip=self._ip,
            pid=os.getpid(),
            generation=place.generation if place else -1,
            rank=place.rank if place else -1,
            world_size=place.world_size if place else 0,
            index=session.index if session else 0,
            running=self._generation is not None,
            held=self._held.own.holdings(),
            bundle=group.id.hex() if group is not None else "",
        )

    def wait_stopped(self) -> None:
        """Returns when this worker's run has ended: a restarted supervisor watches adopted workers with it."""
        self._stopped.wait()

    # -- the member loop ------------------------------------------------------------------------
    def run(self) -> str:
        storage = self._spec.storage
        if not storage.sees_run(self._spec.run.run_id):  # before training: no checkpoint part may land out of reach
            unshared = (
                f"storage_path {storage.storage_path!r} is a local folder, and the worker on {self._ip} does not see "
                f"this run's files in {storage.url()}: that machine has a disk of its own at that path, so "
                "checkpoints would be split across machines. Use storage every node shares: an object store "
                "(storage_path='s3://bucket/prefix', ...) or a network file system mounted at the same path on "
                "every node.")
            logger.error("worker %d: %s", self.worker_id, unshared)
            ray.get(self._supervisor.storage_failed.remote(self.worker_id, unshared))
            self._heartbeat.stop()
            self._stopped.set()
            return unshared
        outcome = Outcome(Exit.JOINED)
        try:
            while True:
                place, self._next = self._next, None
                if place is None:  # else the place was given while parked inside the loop
                    place = self._park(outcome)
                    if place is None:
                        return "the supervisor is gone"
                if isinstance(place, Stop):
                    logger.info("worker %d stops: %s", self.worker_id, place.reason)
                    self._flush_on_stop(place)
                    return place.reason
                outcome = self._run_generation(place)
        finally:
            self._heartbeat.stop()
            self._notices.stop()
            self._store.close()
            self._held.close()
            self._reports.close()
            self._stopped.set()

    def _park(self, outcome: Outcome) -> Assignment | Stop | None:
        """Wait at the supervisor for the next place, with what this worker holds; None if the supervisor is gone."""
        outcome.held = self._held.listed()
        logger.info("worker %d parks holding %s", self.worker_id, self._held)
        try:
            return ray.get(self._supervisor.park.remote(self.worker_id, outcome, self._group.rendezvous.serve()))
        except ray.exceptions.RayActorError:
            self._on_supervisor_gone()
            return None

    def _enter(self, assignment: Assignment) -> None:
        """Join `assignment`'s group as this process's default one (raises if a peer vanished during
        the rendezvous, or the generation ended), and reset what torch holds of the previous world."""
        self._ended.clear()
        self._generation, self._assignment = assignment.generation, assignment
        try:
            self._group.join(assignment)
        except Exception:
            self._generation = None
            self._group.leave()
            raise
        place = (assignment.rank, assignment.world_size)
        reset_for_generation(self._place, place)  # torch's caches of the previous world (worker/group/process_state.py)
        self._place = place

    def _leave(self, generation: int) -> None:
        """Leave `generation`'s group; its reports are recorded before this worker parks."""
        self._generation = None
        self._group.leave()
        if not self._reports.flush(self._spec.elastic.drain_timeout_s):
            logger.warning("worker %d: reports of generation %d not received by the supervisor within "
                           "drain_timeout_s=%ss", self.worker_id, generation, self._spec.elastic.drain_timeout_s)

    def _reform(self, position: Position, reads: tuple[PlaceRead, ...]) -> Assignment | None:
        """`WorkerServices.reform`: park from inside the loop; join the next generation's group when its
        loops go on in place, else keep its place for `run` once the loop unwound."""
        generation = self._assignment.generation
        self._leave(generation)
        place = self._park(self._left(Outcome(Exit.UNWOUND, generation, in_place=position, reads=reads), generation))
        if not isinstance(place, Assignment) or place.previous_ranks is None:
            self._next = place if place is not None else Stop("the supervisor is gone")
            return None
        try:
            self._enter(place)
        except Exception:  # noqa: BLE001 - a peer vanished during rendezvous: the loop unwinds, and parks again
            logger.warning("worker %d could not join generation %d in place", self.worker_id, place.generation,
                           exc_info=True)
            return None
        logger.info("worker %d goes on in place in generation %d as rank %d/%d", self.worker_id, place.generation,
                    place.rank, place.world_size)
        return place

    def _run_generation(self, assignment: Assignment) -> Outcome:
        generation = assignment.generation
        try:
            self._enter(assignment)
        except Exception:  # noqa: BLE001 - a peer vanished during rendezvous, or the generation ended
            return Outcome(Exit.UNWOUND if self._ended.is_set() else Exit.COLLECTIVE_ERROR, generation,
                           traceback.format_exc())
        if assignment.resume is not None:
            self._held.forget_after(assignment.resume.generation, assignment.resume.index)
        # Chosen to be stored, but not whole in storage (plan.store: protocol.py): its holders store it now.
        resumed = part_to_store(assignment.resume, self.worker_id, self.read_checkpoint)
        if resumed is not None:
            self._store.submit(resumed)
        context = TrainContext(assignment, self._spec.run, self._spec.storage)
        session = TrainSession(SessionSetup(self.worker_id, context, self._spec.checkpointing,
                                            self._spec.elastic.store_flush_timeout_s, self._loop,
                                            self._spec.elastic.recover_in_place, self._spec.backend,
                                            self._spec.elastic.sharded_state_budget,
                                            self._spec.elastic.part_safe_wait_s),
                               _Host(self))
        set_session(session)
        self._session = session
        logger.info("worker %d runs generation %d as rank %d/%d", self.worker_id, generation,
                    assignment.rank, assignment.world_size)
        try:
            outcome = self._run_loop(session)
        finally:
            set_session(None)
            session.close()
            if self._generation is not None:  # else left already: parked inside the loop, which then unwound
                self._leave(self._generation)
        generation = session.context.assignment.generation  # a loop that went on in place is in a later one
        self._left(outcome, generation)
        logger.info("worker %d left generation %d: %s", self.worker_id, generation, outcome.exit.value)
        return outcome

    def _run_loop(self, session: TrainSession) -> Outcome:
        """Run the user's loop in `session`: what ended it, in the generation it was in by then."""
        try:
            if self._spec.chdir:
                os.chdir(session.context.working_dir())
            loop = self._loop
            returned = loop.train_fn() if loop.train_config is None else loop.train_fn(loop.train_config)
            session.finish()
            self._store.store_now(session.unstored(), "the last checkpoint")  # whatever the cadence
            place = session.context.assignment
            return Outcome.finished(place.generation, returned if place.rank == 0 else None)
        except PeerLost:
            return Outcome(Exit.UNWOUND if self._ended.is_set() else Exit.COLLECTIVE_ERROR,
                           session.context.assignment.generation, traceback.format_exc())
        except GenerationEnded:
            return Outcome(Exit.UNWOUND, session.context.assignment.generation)
        except Exception as exc:  # noqa: BLE001 - classified below, reported to the supervisor
            detail, generation = traceback.format_exc(), session.context.assignment.generation
            ended = self._ended.is_set() or self._group.aborted
            if _is_collective_error(exc):
                return Outcome(Exit.UNWOUND if ended else Exit.COLLECTIVE_ERROR, generation, detail)
            # after the generation ended it unwound; what it raised may still explain a failure
            return Outcome.user_error(generation, exc, detail, Exit.UNWOUND if ended else Exit.USER_ERROR)

    def _left(self, outcome: Outcome, generation: int) -> Outcome:
        """`outcome` of leaving `generation`: live parts become files (or are dropped if written to since
        their report), and a report whose barrier failed travels with it if its part is held: the next
        generation may resume from it (should it not go on in place)."""
        self._held.own.freeze()
        unagreed = self._session.unagreed if self._session is not None else None
        if unagreed is not None and (generation, unagreed.index) in self._held.own.keys():
            outcome.unagreed = unagreed
        return outcome

    def _hold(self, held: HeldCheckpoint, part: Part, replicate: bool, facts: Facts,
              safe: threading.Event | None = None) -> None:
        """A reported part: held in memory, and with `replicate` copied to the generation's buddy
        (`safe`: set once storage or the buddy holds it: worker/hold/holdings.py)."""
        buddy = self._assignment.buddy if replicate and self._assignment is not None else None
        self._held.hold(held, part, facts, buddy, safe)

    def _send_reports(self, batch: list[Sent]) -> None:
        ray.get(self._supervisor.reports.remote(self.worker_id, batch))

    def _send_replica(self, peer: Any, held: HeldCheckpoint, files: dict[str, bytes]) -> None:
        pieces = as_pieces(files)
        sent = peer.hold_replica.remote(held, files) if pieces is None else peer.hold_replica.remote(held, None, *pieces)
        ray.get(sent, timeout=self._spec.elastic.drain_timeout_s)

    def _on_supervisor_gone(self) -> None:
        """The supervisor is dead for good (restarts spent, or the driver died): this worker is an orphan.
        Workers are detached actors (they outlive a supervisor that Ray restarts), so it ends itself."""
        logger.error("worker %d: the supervisor is gone for good; exiting", self.worker_id)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _on_generation_ended(self, generation: int) -> None:
        if self._generation == generation:
            self._ended.set()
            self._store.interrupt()
            self._group.abort(generation)

    def _flush_on_stop(self, stop: Stop) -> None:
        """Store this worker's share of the checkpoint that a failed run leaves behind."""
        part = part_to_store(stop.flush, self.worker_id, self.read_checkpoint, final=True)
        if part is not None:
            self._store.store_now(part, "the run's last checkpoint")


class _Host:
    """A worker's services to its session (worker/loop/host.py `WorkerServices`), in the generation the worker is in."""

    def __init__(self, worker: Member):
        self._worker = worker
        self.supervisor = worker._supervisor
        self.hold, self.read_held, self.held_state = worker._hold, worker.read_checkpoint, worker._held.own.live_state
        self.hold_replica = lambda held, files: worker._held.hold_replica(held, files, running=True)
        self.replication_s, self.share_delivered = worker._held.replication_s, worker._held.share_delivered
        self.replicated = worker._held.replicated
        self.send_report, self.flush_reports = worker._reports.submit, worker._reports.flush
        self.generation_ended = worker._ended.is_set
        self.reform = worker._reform

    def store(self, part: PartToStore) -> float | None:
        return self._worker._store.submit(part, cancelled=self._worker._ended.is_set)

    def unwind_due(self, index: int) -> bool:
        return self._worker._unwind_due(self._worker._assignment.generation, index)

    def grow_due(self, index: int) -> bool:
        return self._worker._unwind_due(self._worker._assignment.generation, index, grow=True)

    def unwind_at(self, index: int) -> None:
        self._worker.unwind_at(self._worker._assignment.generation, index)


_COLLECTIVE_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "nccl")


def _is_collective_error(exc: BaseException) -> bool:
    """Did the loop fail inside torch.distributed (a lost peer) rather than in the user's own code?"""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MESSAGES)
