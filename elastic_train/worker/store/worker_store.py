"""A worker's checkpoint parts on their way to storage: the store queue (worker/store/queue.py) and what each
upload does around it. A part a newer generation made obsolete is dropped; a stored part is recorded
at the supervisor (after its report, in the same stream: one call carries both); a part given up, or
storage failing, is told to the supervisor; the run's last part is flushed before the worker parks or stops."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable


from elastic_train.checkpoint.manifest import facts_made
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import ElasticConfig
from elastic_train.errors import StorageError
from elastic_train.protocol import Assignment, PartStored
from elastic_train.worker.store.queue import PartObsolete, PartToStore, StoreQueue, obsolete

logger = logging.getLogger(__name__)


class WorkerStore:
    """One worker's uploads; the store queue's callbacks run on its thread."""

    def __init__(self, worker_id: int, supervisor: Any, storage: RunStorage, elastic: ElasticConfig,
                 send: Callable[[PartStored, bool], None], flush_reports: Callable[[float], bool],
                 place: Callable[[], Assignment | None]):
        self._worker_id, self._supervisor, self._storage, self._elastic = worker_id, supervisor, storage, elastic
        self._send, self._flush_reports, self._place = send, flush_reports, place
        self._queue = StoreQueue(self._upload, self._given_up, self._failed, elastic.max_queued_uploads)

    def submit(self, part: PartToStore, cancelled: Callable[[], bool] = lambda: False) -> float | None:
        """Queue `part` (worker/store/queue.py `StoreQueue.submit`)."""
        return self._queue.submit(part, cancelled=cancelled)

    def interrupt(self) -> None:
        """A report waiting for upload room unwinds (its generation ended)."""
        self._queue.interrupt()

    def store_now(self, part: PartToStore | None, what: str) -> None:
        """Store `part` (if any) and wait for every queued upload to be stored and known to the
        supervisor, up to store_flush_timeout_s: the loop returned, or the run ends."""
        if part is not None:
            self._queue.submit(part)
        timeout = self._elastic.store_flush_timeout_s
        deadline = time.monotonic() + timeout
        if not (self._queue.flush(timeout) and self._flush_reports(max(0.0, deadline - time.monotonic()))):
            logger.warning("%s did not reach storage within store_flush_timeout_s=%ss", what, timeout)

    def close(self) -> None:
        self._queue.close(self._elastic.drain_timeout_s)

    def _upload(self, part: PartToStore) -> None:
        """Store a part into its generation's own folder; a part that a newer generation made
        obsolete while it waited is dropped instead (see `queue.obsolete`)."""
        place = self._place()
        if obsolete(part, place):
            raise PartObsolete(f"generation {place.generation} resumed at checkpoint "
                               f"{place.resume.index if place.resume else 0} and reports index {part.index} again")
        began = time.monotonic()
        reported = facts_made(part.files, part.facts)
        facts = self._storage.write_part(part.index, part.files, generation=part.generation, name=part.dir_name,
                                         facts=reported)
        # After its report, which the supervisor knows no checkpoint before: sent now, with it.
        self._send(PartStored(part.generation, part.index, facts, time.monotonic() - began), True)
        part.safe.set()

    def _given_up(self, part: PartToStore, error: Exception) -> None:
        self._supervisor.store_given_up.remote(self._worker_id, part.generation, part.index, str(error))

    def _failed(self, part: PartToStore, error: StorageError) -> None:
        del part
        self._supervisor.storage_failed.remote(self._worker_id, str(error))
