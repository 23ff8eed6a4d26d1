"""Copies this worker's newest checkpoint part into a peer's memory, in the background.

Why: in-place recovery resumes from checkpoints that survivors hold in memory. With Ray Train's
usual pattern (rank 0 alone reports a checkpoint), losing rank 0 would lose every in-memory
checkpoint and force a restart from storage, with the steps since the last commit redone. So each
part is also kept by one peer, the next rank: no single lost worker takes a checkpoint with it.
The copy runs on this thread, newest first (an older part waiting is replaced by a newer one), so
`report()` does not wait for it; the peer tells the supervisor once it holds the replica.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from typing import Any, Callable

from elastic_train.checkpoint.manifest import facts_made, file_facts
from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.background import BackgroundThread
from elastic_train.worker.live_part import LivePart

logger = logging.getLogger(__name__)


Facts = Future[dict[str, dict[str, Any]]] | None  # a part's files' size and checksum, made in the background


Copy = tuple[Any, HeldCheckpoint, "dict[str, bytes] | LivePart", Facts]  # (peer, held, files or a private live part, facts)


class Replicator(BackgroundThread[Copy]):
    def __init__(self, send: Callable[[Any, HeldCheckpoint, dict[str, bytes]], None]):
        """`send(peer, held, files)` copies a part to `peer` and returns once the peer holds it."""
        super().__init__("elastic-replicate")
        self._send = send
        self._next: tuple[int, Copy] | None = None  # (number, the copy to make)
        self._last_s = 0.0  # how long the last copy took: serialized, hashed, sent
        self._delivered: tuple[int, int] | None = None  # (generation, index) of the newest private part the peer holds
        self._start()

    def submit(self, peer: Any, held: HeldCheckpoint, files: dict[str, bytes] | LivePart, facts: Facts) -> None:
        """Copy `files` to `peer`, with the facts they were reported with (the peer's copy is checked
        against them wherever it is served); a part still waiting is replaced. A private live part is
        serialized here, off the loop's thread."""
        with self._changed:
            if self._next is not None:
                self._drop(self._next[0])
            self._next = (self._hand_over(), (peer, held, files, facts))

    def last_s(self) -> float | None:
        """How long the last copy took; None while one is waiting or under way."""
        with self._changed:
            return None if self._unfinished else self._last_s

    def delivered(self) -> tuple[int, int] | None:
        """(generation, index) of the newest private live part (a sharded model's share) that reached
        its peer; one that failed, or was replaced while waiting, did not."""
        with self._changed:
            return self._delivered

    def _waiting(self) -> bool:
        return self._next is not None and not self._closed  # a copy still waiting at close is not made

    def _take(self) -> tuple[Copy, list[int]]:
        (number, copy), self._next = self._next, None
        return copy, [number]

    def _do(self, copy: Copy) -> None:
        peer, held, part, facts = copy
        started = time.monotonic()
        files = part.files() if isinstance(part, LivePart) else part
        made = facts_made(files, facts) or file_facts(files)  # as reported, else (a private live part) made now
        try:
            self._send(peer, dataclasses.replace(held, facts=made or {}), files)
        except Exception as exc:  # noqa: BLE001 - a lost peer: the next generation picks another
            logger.info("checkpoint %d not replicated: %r", held.index, exc)
        else:
            if isinstance(part, LivePart) and part.private:
                with self._changed:
                    self._delivered = (held.generation, held.index)
        self._last_s = time.monotonic() - started
