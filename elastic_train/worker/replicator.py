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
import threading
from concurrent.futures import Future
from typing import Any, Callable

from elastic_train.checkpoint.manifest import facts_made
from elastic_train.protocol import HeldCheckpoint

logger = logging.getLogger(__name__)


Facts = Future[dict[str, dict[str, Any]]]  # a part's files' size and SHA-256, made in the background


class Replicator:
    def __init__(self, send: Callable[[Any, HeldCheckpoint, dict[str, bytes]], None]):
        """`send(peer, held, files)` copies a part to `peer` and returns once the peer holds it."""
        self._send = send
        self._next: tuple[Any, HeldCheckpoint, dict[str, bytes], Facts] | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="elastic-replicate", daemon=True)
        self._thread.start()

    def submit(self, peer: Any, held: HeldCheckpoint, files: dict[str, bytes], facts: Facts) -> None:
        """Copy `files` to `peer`, with the facts they were reported with (the peer's copy is checked
        against them wherever it is served)."""
        with self._changed:
            self._next = (peer, held, files, facts)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._next is not None or self._closed)
                if self._closed:
                    return
                (peer, held, files, facts), self._next = self._next, None
            try:
                self._send(peer, dataclasses.replace(held, facts=facts_made(files, facts) or {}), files)
            except Exception as exc:  # noqa: BLE001 - a lost peer: the next generation picks another
                logger.info("checkpoint %d not replicated: %r", held.index, exc)
