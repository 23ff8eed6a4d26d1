"""Checkpoint commits: the parts workers stored become a committed checkpoint (its manifest written
last), and the run's folder is kept tidy: checkpoints beyond retention, abandoned attempts and torn
folders are removed, never one that a commit or a live worker's upload is still writing."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from elastic_train import events
from elastic_train.checkpoint.layout import Attempt, CommittedCheckpoint
from elastic_train.checkpoint.manifest import Manifest
from elastic_train.checkpoint.retry import TransientStorageError
from elastic_train.checkpoint.storage import CommitRefused, RunStorage
from elastic_train.config import CheckpointConfig
from elastic_train.errors import StorageError
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger, ReportEntry
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry

logger = logging.getLogger(__name__)


def retention_victims(committed: list[CommittedCheckpoint], cfg: CheckpointConfig,
                      writing: set[Attempt] | frozenset[Attempt] = frozenset()) -> list[CommittedCheckpoint]:
    """Committed checkpoints beyond `num_to_keep` best; never the newest (the restore point), nor
    one in `writing` (a rank still uploads its copy of a file that another rank's copy committed):
    that one is a victim of a later call."""
    if cfg.num_to_keep is None or len(committed) <= cfg.num_to_keep:
        return []
    latest = committed[-1]
    if cfg.checkpoint_score_attribute:
        attr, sign = cfg.checkpoint_score_attribute, (1 if cfg.checkpoint_score_order == "max" else -1)
        ranked = sorted(committed, key=lambda c: (attr in c.metrics, sign * c.metrics.get(attr, 0), c.attempt),
                        reverse=True)
    else:
        ranked = sorted(committed, key=lambda c: c.attempt, reverse=True)
    keep = ranked[: cfg.num_to_keep]
    return [c for c in committed if c not in keep and c is not latest and c.attempt not in writing]


class CommitHost(Protocol):
    """What a commit tells the run."""

    def settle(self, generation: int, index: int, committed: CommittedCheckpoint | None) -> None:
        """Checkpoint `index` of `generation` was committed, or never will be (None)."""

    def fail_now(self, message: str) -> None:
        """A permanent storage error: the run cannot store anything, so it fails."""

    def live_workers(self) -> set[int]:
        """The workers that may still store a part."""


class Commits:
    def __init__(self, storage: RunStorage, checkpointing: CheckpointConfig, ledger: CheckpointLedger, host: CommitHost,
                 telemetry: Telemetry, tasks: Tasks):
        self._storage = storage
        self._checkpointing = checkpointing
        self._ledger = ledger
        self._host = host
        self._telemetry = telemetry
        self._tasks = tasks
        self.committed: list[CommittedCheckpoint] = []

    @property
    def newest(self) -> CommittedCheckpoint | None:
        return self.committed[-1] if self.committed else None

    def recover(self, sweep: bool) -> int:
        """Find where an earlier run with this name left off: the newest committed checkpoint whose
        files verify. Newer ones that do not, and (if `sweep`) torn folders (no manifest), are removed:
        the run goes on from the whole one and will write those indices again. Returns the newest
        generation found in storage: generations go on from it, so a worker of an earlier fit that is
        still writing never writes into a folder (index and generation) that this fit commits."""
        stored_generation = max((a.generation for a in self._storage.attempts()), default=-1)
        committed = self._storage.committed()
        whole, corrupt = self._storage.newest_whole(committed)
        bad = {c.attempt for c, _ in corrupt}
        self.committed = [c for c in committed if c.attempt not in bad]
        for c, problems in corrupt:
            self._telemetry.record(events.CheckpointCorrupt(c.index, c.path, problems))
            self._storage.delete(c.attempt)
        if sweep:
            self.sweep_torn()
        if whole is not None:
            self._telemetry.record(events.RestoredFromStorage(whole.index, whole.path))
        return stored_generation

    def sweep_torn(self) -> None:
        """Remove checkpoint folders that hold no commit of this run. A folder whose commit is under
        way is left alone (the storage refuses it), and the commits are read only once a folder is
        claimed for removal, so one that has just been committed is kept."""
        def is_committed(attempt: Attempt) -> bool:
            return attempt in {c.attempt for c in list(self.committed)}

        for attempt in self._storage.sweep(is_committed):
            logger.info("removed %s: it was never committed, or is corrupt", self._storage.url(attempt.dirname))

    def part_stored(self, worker_id: int, generation: int, index: int, facts: dict[str, Any]) -> None:
        """A worker stored its part of checkpoint `index` of `generation`; the last part commits the
        checkpoint. A part of another generation than the one the ledger holds for `index` is
        ignored: it was stored into its own generation's folder, which is never committed."""
        entry = self._ledger.mark_stored(index, worker_id, facts, generation)
        if entry is not None:
            self.commit_if_ready(index, entry)

    def part_given_up(self, generation: int, index: int) -> None:
        """A worker could not store its part of checkpoint `index` of `generation`: it never commits."""
        entry = self._ledger.entries.get(index)
        if entry is not None and entry.generation == generation:
            entry.given_up = True
            self._host.settle(generation, index, None)

    def commit_if_ready(self, index: int, entry: ReportEntry) -> None:
        """Commit checkpoint `index` once it is whole and stored: at its last part's storing, or at its
        last report, which may come after (a dict checkpoint every rank holds is stored by rank 0
        without waiting for the others' reports: worker/store/storing.py)."""
        if not entry.ready_to_commit:
            return
        generation = entry.generation
        try:
            # From here until `_commit` ends, no sweep or deletion of this process removes the folder.
            self._storage.begin_commit(Attempt(index, generation, entry.dir_name))
        except CommitRefused as exc:
            entry.given_up = True
            self._host.settle(generation, index, None)
            self._telemetry.record(events.CommitRefused(index, generation, str(exc)))
            return
        entry.committed = True
        manifest = Manifest(step=index, generation=entry.generation, world_size=entry.world_size,
                            files=entry.file_facts(), metrics=entry.metrics or {},
                            loader_states=entry.loader_states)
        self._tasks.track(self._commit(index, manifest, entry.dir_name))

    async def _commit(self, index: int, manifest: Manifest, name: str | None) -> None:
        """Commit checkpoint `index` (`part_stored` began it), then remove what it makes
        obsolete: older torn attempts, and checkpoints beyond retention."""
        loop = asyncio.get_running_loop()
        attempt = Attempt(index, manifest.generation, name)
        try:
            try:
                began = time.monotonic()
                stored = await loop.run_in_executor(None, self._storage.commit, index, manifest, name)
                commit_s = time.monotonic() - began
                # A new list, not a sort in place: a sweep on another thread reads it (a list being
                # sorted looks empty meanwhile). A named folder holds its newest commit only.
                self.committed = sorted([*(c for c in self.committed if name is None or c.name != name), stored],
                                        key=lambda c: c.attempt)
            finally:
                self._storage.end_commit(attempt)
        except CommitRefused as exc:
            logger.warning("checkpoint %d: %s; training goes on", index, exc)
            self._host.settle(manifest.generation, index, None)
            self._telemetry.record(events.CommitRefused(index, manifest.generation, str(exc)))
            return
        except TransientStorageError as exc:
            logger.warning("checkpoint %d: %s; training goes on", index, exc)
            self._host.settle(manifest.generation, index, None)
            self._telemetry.record(events.CommitGivenUp(index, str(exc)))
            return
        except StorageError as exc:
            self._host.fail_now(str(exc))
            return
        self._telemetry.record(events.CheckpointCommitted(index, manifest.generation, len(manifest.files),
                                                          manifest.total_bytes, round(commit_s, 4)))
        self._host.settle(manifest.generation, index, stored)
        # A folder that a live worker may still upload a part into is not removed yet: removed under
        # it, it would be written again (torn) by that worker. It goes at a later commit, or at the end.
        live = self._host.live_workers()
        writing = {Attempt(i, e.generation, e.dir_name) for i, e in list(self._ledger.entries.items())
                   if e.unstored() & live}
        try:
            for torn in self._ledger.abandoned_before(index, live):
                await loop.run_in_executor(None, self._storage.delete, Attempt(*torn))
            await self._remove(retention_victims(self.committed, self._checkpointing, writing))
        except TransientStorageError as exc:
            logger.warning("could not remove an obsolete checkpoint folder: %s; left for the sweep", exc)
        except StorageError as exc:
            self._host.fail_now(str(exc))

    async def _remove(self, victims: list[CommittedCheckpoint]) -> None:
        loop = asyncio.get_running_loop()
        for victim in victims:
            if victim in self.committed:  # another commit's clean-up may have taken it meanwhile
                self.committed = [c for c in self.committed if c is not victim]
                await loop.run_in_executor(None, self._storage.delete, victim.attempt)

    async def close(self, retry_deadline_s: float) -> None:
        """The run is over and its workers are gone. A commit still under way (the last checkpoint's,
        retrying a slow store) may outlast them: wait for it, up to the storage retry deadline, so the
        run does not end before its manifest is written; then apply retention to what was spared
        while workers wrote, and sweep what no commit holds."""
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self._storage.wait_for_commits, retry_deadline_s):
            logger.warning("a checkpoint commit is still under way after storage_retry_deadline_s=%ss; its folder "
                           "is left for the next run with this name to verify", retry_deadline_s)
        try:
            await self._remove(retention_victims(self.committed, self._checkpointing))
            await loop.run_in_executor(None, self.sweep_torn)
        except StorageError as exc:
            logger.warning("could not tidy the run's folder: %s", exc)
