"""Storing a session's reported parts: the cadence of the live dict parts its ranks decide on, the
supervisor's reply for the others, the newest part the cadence skipped (stored if the loop returns),
and the wait for a SYNC / NO_UPLOAD checkpoint's commit.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import ray

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.manifest import facts_soon
from elastic_train.errors import CheckpointError, GenerationEnded
from elastic_train.protocol import HeldCheckpoint, ReportReply
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.loop.host import SessionSetup, WorkerServices
from elastic_train.worker.store.queue import PartToStore

logger = logging.getLogger(__name__)

UPLOAD_WAIT_NOTED_S = 0.01  # a report that waited longer than this for room in the upload queue is an event


class PartStoring:
    """One session's storing of this worker's parts."""

    def __init__(self, setup: SessionSetup, host: WorkerServices):
        self._setup, self._host = setup, host
        self._live_reports, self._live_stored_at = 0, time.monotonic()  # live parts reported since one was stored
        self._unstored: tuple[PartToStore, LivePart | None] | None = None  # the newest part the cadence skipped

    @property
    def _generation(self) -> int:
        """The generation the loop is in: a loop that goes on in place changes it under the session."""
        return self._setup.context.assignment.generation

    def live_due(self) -> bool:
        """Is a live part reported now due to be stored (the cadence, counting it)?"""
        return self._setup.checkpointing.store_due(self._live_reports + 1, time.monotonic() - self._live_stored_at)

    def live_reported(self) -> None:
        self._live_reports += 1

    def live_stored(self) -> None:
        """Every rank's live part was due: rank 0's is stored, the cadence starts again."""
        self._live_reports, self._live_stored_at, self._unstored = 0, time.monotonic(), None

    def skipped(self, part: PartToStore | None, live: LivePart | None = None) -> None:
        """`part` (None: nothing of this rank's) is the newest the cadence skipped; `live` gives its files."""
        self._unstored = None if part is None else (part, live)

    def apply_reply(self, index: int, reply_ref: Any, held: HeldCheckpoint | None, files: dict[str, bytes] | None,
               facts: Future[dict[str, dict[str, Any]]] | None, live: LivePart | None, replicate: bool) -> bool:
        """Act on the supervisor's reply to report `index`; returns whether the group re-forms after it."""
        reply: ReportReply = ray.get(reply_ref)
        if not reply.accepted:
            logger.warning("report %d rejected: this worker was fenced out of generation %d", index, self._generation)
            raise GenerationEnded()
        if reply.list_stored:  # a checkpoint the loop stored itself: listed here, then committed
            facts = self._setup.context.storage.stored_facts(reply.dir_name)
            ray.get(self._host.supervisor.part_stored.remote(self._setup.worker_id, self._generation, index, facts))
        if held is not None and (files is not None or live is not None):
            if reply.store and live is not None:
                files, facts = self.copy_live(held, live, replicate)
                self.live_stored()
            part = PartToStore(self._generation, index, files or {}, replaceable=reply.replaceable,
                               dir_name=reply.dir_name, facts=facts)
            self._unstored = None if reply.store else (part, live)
            if reply.store_part:
                self.upload(part)
        return reply.unwind

    def copy_live(self, held: HeldCheckpoint, live: LivePart,
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
        self._host.hold(held, files, replicate, facts)
        return files, facts

    def store_files(self, part: PartToStore) -> None:
        """A part of files stored without asking the supervisor (no cadence): the newest is stored."""
        self._unstored = None
        self.upload(part)

    def upload(self, part: PartToStore) -> None:
        """Hand a part to the store queue (it waits for room in the upload queue)."""
        waited = self._host.store(part)
        if waited is None:  # the generation ended while the report waited for upload room
            raise GenerationEnded()
        if waited > UPLOAD_WAIT_NOTED_S:
            self._host.supervisor.upload_waited.remote(self._setup.worker_id, part.index, waited)

    def unstored(self) -> PartToStore | None:
        """The newest reported part, when the cadence skipped it (the loop returned: it is stored now);
        None if there is none, or a live one was written to since its report."""
        if self._unstored is None:
            return None
        part, live = self._unstored
        if live is not None:
            files = live.files()
            if files is None:
                logger.warning("the last checkpoint (report %d) was written to after its report: not stored", part.index)
                return None
            part.files = files
        return part

    def committed(self, generation: int, index: int, timeout_s: float) -> tuple[CommittedCheckpoint | None, bool]:
        """Checkpoint `index` of `generation` once committed (None: not within `timeout_s`, or never), and
        whether `generation` is over."""
        return ray.get(self._host.supervisor.checkpoint_settled.remote(generation, index, timeout_s))

    def wait_committed(self, index: int) -> CommittedCheckpoint:
        """SYNC / NO_UPLOAD: return once checkpoint `index` is committed in storage."""
        timeout_s = self._setup.settle_timeout_s
        committed, over = self.committed(self._generation, index, timeout_s)
        if committed is not None:
            return committed
        if over or self._host.generation_ended():  # a peer was lost before storing its part: the group re-forms
            raise GenerationEnded()
        raise CheckpointError(
            f"the checkpoint of report {index} was not committed to {self._setup.context.storage.url()} within "
            f"store_flush_timeout_s={timeout_s}s (storage kept failing, or a part was given up); "
            "see the run's events.")
