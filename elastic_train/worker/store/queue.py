"""Stores a worker's checkpoint parts in the background, one at a time, newest first.

Why: `report(checkpoint=...)` must cost the training loop no more than an in-memory snapshot. The
upload runs on this thread instead, one at a time, in order. Under a cadence the user chose, a newer
snapshot replaces one still waiting (its state is older, so storing it would only delay the newer
one); otherwise every part is stored, and when `max_queued` parts already wait, `submit` waits too:
memory stays bounded, and the loop slows to what storage takes. A storage outage is retried
(`checkpoint/retry.py`); when its retry deadline passes the snapshot is given up, with a warning.

A part of a generation that has since ended is dropped before its upload when the newer
generation reports its index again (`obsolete`): the supervisor has forgotten that checkpoint, so
storing it could only leave a torn folder. Storage keeps each generation's attempt in a folder of
its own, so a part already on its way when its generation ends can never touch another's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from elastic_train.checkpoint.manifest import CorruptCheckpointError
from elastic_train.checkpoint.retry import TransientStorageError
from elastic_train.errors import StorageError
from elastic_train.protocol import Assignment
from elastic_train.worker.background import BackgroundThread

logger = logging.getLogger(__name__)


@dataclass
class PartToStore:
    """One rank's files of checkpoint `index`, reported in `generation`."""

    generation: int
    index: int
    files: dict[str, bytes]
    replaceable: bool = True  # a newer part may replace it while it waits
    final: bool = False  # what a failed run leaves behind (Stop.flush): stored whatever generation it is of
    dir_name: str | None = None  # the folder the report named; None: the attempt's own
    # The files' size and checksum as reported (or on their way): checked as they are stored.
    facts: dict[str, dict[str, Any]] | Future[dict[str, dict[str, Any]]] | None = None
    safe: threading.Event = field(default_factory=threading.Event)  # set once stored (the supervisor knows), or copied


class PartObsolete(Exception):
    """Raised by an upload for a part that is no longer wanted: the store queue drops it."""


def obsolete(part: PartToStore, assignment: Assignment | None) -> bool:
    """Is `part` of an older generation than the worker's latest `assignment`, at an index that the
    newer generation reports again? The supervisor rewound its record past that index when the newer
    generation opened, so the part can never be committed. Parts at or below the newer generation's
    resume index may still be (checkpoints kept by score are all stored), and so are kept."""
    if part.final or assignment is None or assignment.generation <= part.generation:
        return False
    resumed_at = assignment.resume.index if assignment.resume is not None else 0
    return part.index > resumed_at


class StoreQueue(BackgroundThread[PartToStore]):
    """Parts wait in order; a replaceable one is replaced by the next."""

    def __init__(
        self,
        upload: Callable[[PartToStore], None],
        on_given_up: Callable[[PartToStore, Exception], None],
        on_failed: Callable[[PartToStore, StorageError], None],
        max_queued: int,
    ):
        """`upload` stores a part (retrying transient errors itself; raising `PartObsolete` for a
        part no longer wanted); `on_given_up` hears of a part given up after its retry deadline, or
        found corrupt (its copy in memory no longer matches its report), `on_failed` of a permanent
        storage error."""
        super().__init__("elastic-store")
        self._upload = upload
        self._on_given_up = on_given_up
        self._on_failed = on_failed
        self._max_queued = max_queued
        self._pending: collections.deque[tuple[int, PartToStore]] = collections.deque()  # (number, part)
        self._start()

    def submit(self, part: PartToStore, cancelled: Callable[[], bool] = lambda: False) -> float | None:
        """Queue `part`; returns how long it waited for room (seconds), or None if `cancelled()` came
        true first (checked at `interrupt()`): then it is not queued."""
        started = time.monotonic()
        with self._changed:
            self._changed.wait_for(lambda: len(self._pending) < self._max_queued or self._closed
                                   or self._pending[-1][1].replaceable or cancelled())
            if cancelled():
                return None
            if self._pending and self._pending[-1][1].replaceable:
                number, replaced = self._pending.pop()
                logger.info("checkpoint %d replaced by %d before its upload started", replaced.index, part.index)
                self._drop(number)
            self._pending.append((self._hand_over(), part))
        return time.monotonic() - started

    def interrupt(self) -> None:
        """Wake a `submit` waiting for room, to check whether it was cancelled."""
        with self._changed:
            self._changed.notify_all()

    def _waiting(self) -> bool:
        return bool(self._pending)

    def _take(self) -> tuple[PartToStore, list[int]]:
        number, part = self._pending.popleft()
        return part, [number]

    def _do(self, part: PartToStore) -> None:
        try:
            self._upload(part)
        except PartObsolete as exc:
            logger.info("checkpoint %d of generation %d dropped before its upload: %s", part.index,
                        part.generation, exc)
        except CorruptCheckpointError as exc:
            logger.error("checkpoint %d not stored: %s", part.index, exc)
            self._on_given_up(part, exc)
        except TransientStorageError as exc:
            logger.warning("checkpoint %d not stored, storage kept failing: %s; training goes on, the "
                           "next checkpoint will be tried", part.index, exc)
            self._on_given_up(part, exc)
        except StorageError as exc:
            logger.error("checkpoint %d cannot be stored: %s", part.index, exc)
            self._on_failed(part, exc)
        except Exception as exc:  # noqa: BLE001 - an unexpected fault is the run's, not the thread's
            logger.exception("checkpoint %d upload failed", part.index)
            self._on_failed(part, StorageError(f"uploading checkpoint {part.index} failed: {exc!r}"))
