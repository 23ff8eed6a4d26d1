"""Copies this worker's newest checkpoint part into a peer's memory, in the background.

Why: in-place recovery resumes from checkpoints that survivors hold in memory. With Ray Train's
usual pattern (rank 0 alone reports a checkpoint), losing rank 0 would lose every in-memory
checkpoint and force a restart from storage, with the steps since the last commit redone. So each
part is also kept by one peer, the next rank: no single lost worker takes a checkpoint with it.
The copy runs on this thread, newest first (an older part waiting is replaced by a newer one), so
`report()` does not wait for it; the peer tells the supervisor once it holds the replica. A part
stored first is copied all the same: a resume from memory needs every part in a survivor's memory
(one stored part alone would send the whole resume to storage, at a pace that depended on which
thread won). The part's `safe` event, set by the first of the two, tells the report that waits for it
(`ElasticConfig.part_safe_wait_s`).
A part of up to `INLINE_BYTES` travels in pieces Ray carries inside the call: through the object
store, a 0.13 MB part cost the loop ~0.9 ms more per copy here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from elastic_train.checkpoint.manifest import facts_made, file_facts
from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.background import BackgroundThread
from elastic_train.worker.hold.live_part import LivePart

logger = logging.getLogger(__name__)


Facts = Future[dict[str, dict[str, Any]]] | None  # a part's files' size and checksum, made in the background


# (peer, held, files or a private live part, facts, set once the part is safe beyond this process: stored or copied)
Copy = tuple[Any, HeldCheckpoint, "dict[str, bytes] | LivePart", Facts, "threading.Event | None"]


INLINE_BYTES = 8 << 20  # a part up to this size is sent in pieces inside the call (Ray inlines an argument below ~100 KiB)
_PIECE_BYTES = 64 << 10


def as_pieces(files: dict[str, bytes]) -> list[tuple[str, bytes]] | None:
    """A small part as (name, piece) arguments for one call; None for a part too large to inline."""
    if sum(len(data) for data in files.values()) > INLINE_BYTES:
        return None
    return [(name, data[i:i + _PIECE_BYTES]) for name, data in files.items()
            for i in range(0, max(len(data), 1), _PIECE_BYTES)]


def from_pieces(pieces: tuple[tuple[str, bytes], ...]) -> dict[str, bytes]:
    """The files `as_pieces` cut, joined again."""
    joined: dict[str, list[bytes]] = {}
    for name, piece in pieces:
        joined.setdefault(name, []).append(piece)
    return {name: b"".join(parts) for name, parts in joined.items()}


class Replicator(BackgroundThread[Copy]):
    def __init__(self, send: Callable[[Any, HeldCheckpoint, dict[str, bytes]], None]):
        """`send(peer, held, files)` copies a part to `peer` and returns once the peer holds it."""
        super().__init__("elastic-replicate")
        self._send = send
        self._next: tuple[int, Copy] | None = None  # (number, the copy to make)
        self._last_s = 0.0  # how long the last copy took: serialized, hashed, sent
        self._delivered: tuple[int, int] | None = None  # (generation, index) of the newest private part the peer holds
        self._start()

    def submit(self, peer: Any, held: HeldCheckpoint, files: dict[str, bytes] | LivePart, facts: Facts,
               safe: threading.Event | None = None) -> None:
        """Copy `files` to `peer`, with the facts they were reported with (the peer's copy is checked
        against them wherever it is served); a part still waiting is replaced. A private live part is
        serialized here, off the loop's thread. `safe`: set once the part is stored, and here once the
        peer holds the copy."""
        with self._changed:
            if self._next is not None:
                self._drop(self._next[0])
            self._next = (self._hand_over(), (peer, held, files, facts, safe))

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
        peer, held, part, facts, safe = copy
        started = time.monotonic()
        files = part.files() if isinstance(part, LivePart) else part
        made = facts_made(files, facts) or file_facts(files)  # as reported, else (a private live part) made now
        try:
            self._send(peer, dataclasses.replace(held, facts=made or {}), files)
        except Exception as exc:  # noqa: BLE001 - a lost peer: the next generation picks another
            logger.info("checkpoint %d not replicated: %r", held.index, exc)
        else:
            if safe is not None:
                safe.set()
            if isinstance(part, LivePart) and part.private:
                with self._changed:
                    self._delivered = (held.generation, held.index)
        self._last_s = time.monotonic() - started
