"""One thread that works through what the loop hands it, so that `report()` never waits on storage
or on a peer: the base of the store queue, the replicator and the report sender.

Each of those says what waiting work is (a queue, the newest part, a batch) and how a piece of it is
done; this class owns the thread, the condition every party waits on, `flush` and `close`. Each piece
handed over is numbered, and `flush` waits for those numbered before it was called to be done (or
replaced, or dropped): not for a loop that keeps handing work over to pause.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Work = TypeVar("Work")


class BackgroundThread(Generic[Work]):
    """Subclasses implement `_waiting`, `_take` and `_do`; holding `self._changed`, they number each
    piece of work as they take it in (`_hand_over`) and give up a waiting one with `_drop`; they call
    `_start` once their own fields exist."""

    def __init__(self, name: str):
        self._changed = threading.Condition()
        self._handed = 0  # the number of the newest piece handed over
        self._unfinished: set[int] = set()  # the numbers of the pieces waiting or under way
        self._urgent = False  # a flush or close waits: a subclass that batches sends now
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # -- what a subclass says ----------------------------------------------------------------------
    def _waiting(self) -> bool:
        """Is there work to take? (The lock is held.)"""
        raise NotImplementedError

    def _take(self) -> tuple[Work, list[int]]:
        """The next piece of work and the numbers of the pieces it stands for. (The lock is held; a
        subclass that batches may wait on `self._changed` here.)"""
        raise NotImplementedError

    def _do(self, work: Work) -> None:
        """Do it, on this thread, without the lock. An exception is logged and the thread goes on:
        a subclass handles the ones it expects."""
        raise NotImplementedError

    # -- for subclasses and callers ----------------------------------------------------------------
    def _hand_over(self, wake: bool = True) -> int:
        """Number a piece of work handed over; with `wake`, wake the thread (a batching one that is
        waiting anyway need not switch). (The lock is held.)"""
        self._handed += 1
        self._unfinished.add(self._handed)
        if wake:
            self._changed.notify_all()
        return self._handed

    def _drop(self, number: int) -> None:
        """A waiting piece is given up (replaced by a newer one): it counts as done. (The lock is held.)"""
        self._unfinished.discard(number)
        self._changed.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until the work handed over so far is done; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            target = self._handed

            def done() -> bool:
                return min(self._unfinished, default=target + 1) > target

            if done():
                return True
            self._urgent = True
            self._changed.notify_all()
            return self._changed.wait_for(done, max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float | None = None) -> None:
        """End the thread once what is waiting is done (a subclass may drop it instead: `_waiting`);
        with `timeout_s`, first wait that long for it."""
        if timeout_s is not None and not self.flush(timeout_s):
            logger.warning("%s: work still under way after %.0fs; left unfinished", self._thread.name, timeout_s)
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting() or self._closed)
                if not self._waiting():
                    return
                work, numbers = self._take()
                self._changed.notify_all()  # room for work that a caller holds back
            try:
                self._do(work)
            except Exception:  # noqa: BLE001 - an unexpected fault must not end the thread
                logger.exception("%s: unexpected failure", self._thread.name)
            finally:
                with self._changed:
                    self._unfinished.difference_update(numbers)
                    self._changed.notify_all()
