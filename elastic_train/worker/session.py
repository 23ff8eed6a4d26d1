"""What the user's loop talks to inside a worker: report, get_checkpoint, get_context.

One `TrainSession` lives per generation. `report()` keeps an in-memory snapshot of the checkpoint
(the state survivors resume from), tells the supervisor, hands the snapshot to the persister, and
unwinds the loop with `GenerationEnded` when the group is about to be re-formed.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Callable, Protocol

import ray

from elastic_train.checkpoint.checkpoint import Checkpoint, checkpoint_from_files
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.protocol import HeldCheckpoint, ReportReply, ResumePlan
from elastic_train.worker.context import TrainContext
from elastic_train.worker.persister import PartUpload

logger = logging.getLogger(__name__)


class GenerationEnded(BaseException):
    """Unwinds the user's loop when its generation ends.

    A BaseException, so that the user's `except Exception:` does not swallow it.
    """


class StatefulLoader(Protocol):
    def loader_state(self) -> dict[str, Any]: ...


class CheckpointMemory:
    """The newest reported checkpoint snapshots, by (generation, report index): after a rewind a new
    generation reports the same indices again, and a part of an older generation must never be served
    for one of a newer. Thread-safe."""

    def __init__(self, keep: int):
        self._keep = keep
        self._parts: OrderedDict[tuple[int, int], tuple[HeldCheckpoint, dict[str, bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, held: HeldCheckpoint, files: dict[str, bytes], evict: bool = True) -> None:
        """Keep a part; with `evict`, drop the oldest beyond `keep`. A worker tells the supervisor
        what it holds when it parks; from then on, until its next generation, nothing is evicted."""
        with self._lock:
            key = (held.generation, held.index)
            if key in self._parts:  # more of the same checkpoint (parts handed over by two peers): merged
                known, held_files = self._parts[key]
                files = {**held_files, **files}
                held = dataclasses.replace(known, names=sorted(files))
            self._parts[key] = (held, files)
            while evict and len(self._parts) > self._keep:
                self._parts.popitem(last=False)

    def keys(self) -> list[tuple[int, int]]:
        """(generation, index) of every part held."""
        with self._lock:
            return list(self._parts)

    def holdings(self) -> list[HeldCheckpoint]:
        """What is held, for a restarted supervisor."""
        with self._lock:
            return [held for held, _ in self._parts.values()]

    def get(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        found = self.find(generation, index, names)
        if len(found) < len(names):
            raise KeyError(f"checkpoint {index} of generation {generation} is no longer held by this worker")
        return found

    def find(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Those of `names` held for checkpoint `index` of `generation`."""
        with self._lock:
            _, part = self._parts.get((generation, index), (None, {}))
            return {n: part[n] for n in names if n in part}


class TrainSession:
    def __init__(
        self,
        worker_id: int,
        supervisor: Any,
        context: TrainContext,
        keep: Callable[[HeldCheckpoint, dict[str, bytes]], None],
        read_held: Callable[[int, int, list[str]], dict[str, bytes]],
        persist: Callable[[PartUpload], None],
        generation_ended: Callable[[], bool],
        storage: RunStorage,
    ):
        self.worker_id = worker_id
        self.context = context
        self._supervisor = supervisor
        self._keep = keep
        self._read_held = read_held
        self._persist = persist
        self._generation_ended = generation_ended
        self._storage = storage
        self.unpersisted: PartUpload | None = None  # the newest reported part, when the cadence skipped it
        resume = context.assignment.resume
        self.index = resume.index if resume else 0
        self._resume_states = list(resume.loader_states) if resume else []
        self._loaders: list[StatefulLoader] = []
        self._restored: Checkpoint | None = None
        self._restored_loaded = False
        self._scratch: str | None = None

    # -- the user's API -------------------------------------------------------------------------
    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
        """Snapshot the checkpoint, tell the supervisor, hand the part to the persister; return once
        every rank has made this report. `report()` is a barrier, as in Ray Train: no rank runs a
        step ahead of a lost peer's last report, even in a loop with no collective, so at most one
        step is redone; and the newest checkpoint every rank reported is the oldest this worker may
        still need, never evicted by the snapshot kept here."""
        if self._generation_ended():
            raise GenerationEnded()
        self.index += 1
        files = checkpoint.files() if checkpoint is not None else None
        assignment = self.context.assignment
        loader_states = [loader.loader_state() for loader in self._loaders]
        if files is not None:
            self._keep(HeldCheckpoint(self.index, assignment.generation, assignment.rank, sorted(files),
                                      loader_states), files)
        reply = self._supervisor.report.remote(
            self.worker_id,
            assignment.generation,
            self.index,
            dict(metrics) if assignment.rank == 0 else None,
            sorted(files) if files is not None else None,
            loader_states,
        )
        part = PartUpload(assignment.generation, self.index, files) if files is not None else None
        if self._settle(self.index, reply, part):  # this report was made: the next generation resumes from it
            raise GenerationEnded()

    def get_checkpoint(self) -> Checkpoint | None:
        if not self._restored_loaded:
            self._restored = self._load_resume_checkpoint()
            self._restored_loaded = True
        return self._restored

    # -- for prepare_data_loader ----------------------------------------------------------------
    def register_loader(self, loader: StatefulLoader) -> dict[str, Any] | None:
        """Track a prepared loader; returns the position it resumes from, if any."""
        position = len(self._loaders)
        self._loaders.append(loader)
        return self._resume_states[position] if position < len(self._resume_states) else None

    # -- internals ------------------------------------------------------------------------------
    def _settle(self, index: int, reply_ref: Any, part: PartUpload | None) -> bool:
        """Act on the supervisor's reply to report `index`; returns whether the group re-forms after it."""
        reply: ReportReply = ray.get(reply_ref)
        if not reply.accepted:
            logger.warning("report %d rejected: this worker was fenced out of generation %d",
                           index, self.context.assignment.generation)
            raise GenerationEnded()
        if part is not None:
            part.replaceable = reply.replaceable
            self.unpersisted = None if reply.persist else part
            if reply.persist:
                self._persist(part)
        return reply.unwind

    def _load_resume_checkpoint(self) -> Checkpoint | None:
        plan = self.context.assignment.resume
        if plan is None:
            return None
        files = self._storage.read_verified(plan.stored) if plan.stored is not None else self._gather(plan)
        self._scratch = tempfile.mkdtemp(prefix="elastic_train_session_")
        return checkpoint_from_files(files, self._scratch)

    def _gather(self, plan: ResumePlan) -> dict[str, bytes]:
        """The checkpoint's files from the memory of the survivors that hold them (this one included)."""
        files: dict[str, bytes] = {}
        remote = []
        for holder, names in plan.holders.items():
            if holder == self.worker_id:
                files.update(self._read_held(plan.generation, plan.index, names))
            else:
                remote.append(self.context.assignment.peers[holder].read_checkpoint.remote(
                    plan.generation, plan.index, names))
        for part in ray.get(remote):
            files.update(part)
        return files

    def close(self) -> None:
        """The generation is over: remove what this session wrote to local disk."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


_current: TrainSession | None = None


def set_session(session: TrainSession | None) -> None:
    global _current
    _current = session


def current_session() -> TrainSession | None:
    """The running generation's session, or None outside a worker's loop."""
    return _current


def get_session(caller: str) -> TrainSession:
    if _current is None:
        raise RuntimeError(
            f"elastic_train.{caller}() works only inside train_loop_per_worker, run by TorchTrainer.fit()."
        )
    return _current
