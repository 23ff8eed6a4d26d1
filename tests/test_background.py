"""The one background-thread base of the store queue, the replicator and the report sender: work
handed over is done in order on its thread, a replaced piece counts as done, and `flush` waits for
what was handed over before it, not for a loop that keeps handing over more to pause."""

from __future__ import annotations

import os
import threading

import pytest

from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.hold.replicator import INLINE_BYTES, Replicator, as_pieces, from_pieces
from elastic_train.worker.store.queue import PartToStore, StoreQueue


def _held(index: int) -> HeldCheckpoint:
    return HeldCheckpoint(index, 0, 0, ["model.pt"], [])


@pytest.mark.timeout(30)
def test_the_replicator_copies_the_newest_part_and_a_flush_waits_only_for_what_came_before_it():
    started, release = threading.Event(), threading.Event()
    sent: list[int] = []

    def send(peer, held, files):
        started.set()
        release.wait(10)
        sent.append(held.index)

    replicator = Replicator(send)
    replicator.submit("peer", _held(0), {"model.pt": b"0"}, None)
    assert started.wait(5)  # index 0 is being sent: 1 waits, then 2 replaces it
    replicator.submit("peer", _held(1), {"model.pt": b"1"}, None)
    replicator.submit("peer", _held(2), {"model.pt": b"2"}, None)
    assert not replicator.flush(0.2)  # 0 still under way
    release.set()
    assert replicator.flush(5) and sent == [0, 2]

    # A flush returns once what came before it is done, though more keeps coming.
    release.clear()
    started.clear()
    replicator.submit("peer", _held(3), {"model.pt": b"3"}, None)
    assert started.wait(5)  # 3 is being sent
    flushed = threading.Event()
    waiter = threading.Thread(target=lambda: flushed.set() if replicator.flush(5) else None)
    waiter.start()
    replicator.submit("peer", _held(4), {"model.pt": b"4"}, None)
    release.set()
    waiter.join(5)
    assert flushed.is_set() and replicator.flush(5) and sent == [0, 2, 3, 4]

    # A copy still waiting when the worker closes is not made: its peer may be gone with the run.
    release.clear()
    started.clear()
    replicator.submit("peer", _held(5), {"model.pt": b"5"}, None)
    assert started.wait(5)
    replicator.submit("peer", _held(6), {"model.pt": b"6"}, None)
    replicator.close()
    release.set()
    replicator._thread.join(5)
    assert not replicator._thread.is_alive() and sent == [0, 2, 3, 4, 5]


@pytest.mark.timeout(30)
def test_a_part_stored_first_is_copied_all_the_same_and_a_copied_one_is_marked_safe():
    """A resume from memory needs every part in a survivor's memory: storage having a part first
    does not spare its copy (else which thread won would decide where a resume is served from)."""
    sent: list[int] = []
    replicator = Replicator(lambda peer, held, files: sent.append(held.index))
    stored = threading.Event()
    stored.set()
    replicator.submit("peer", _held(1), {"model.pt": b"1"}, None, stored)
    assert replicator.flush(5) and sent == [1] and stored.is_set()
    safe = threading.Event()
    replicator.submit("peer", _held(2), {"model.pt": b"2"}, None, safe)
    assert safe.wait(5) and replicator.flush(5) and sent == [1, 2]  # copied: the report waiting on it goes on
    replicator.close()


@pytest.mark.timeout(10)
def test_a_small_part_travels_in_pieces_and_is_joined_whole():
    files = {"model.pt": os.urandom(300_000), "empty": b"", "meta.json": b"{}"}
    pieces = as_pieces(files)
    assert pieces is not None and max(len(p) for _, p in pieces) <= 64 << 10
    assert from_pieces(tuple(pieces)) == files
    assert as_pieces({"big": bytes(INLINE_BYTES + 1)}) is None


@pytest.mark.timeout(30)
def test_a_flush_is_not_fooled_by_a_part_replaced_after_it_began():
    """Part 1 uploads; a flush begins; parts 2 and 3 come, 3 replacing 2. The flush waits for part 1:
    a replacement counts as done only for the part it replaced."""
    uploading, release = threading.Event(), threading.Event()
    stored: list[int] = []

    def upload(part: PartToStore) -> None:
        uploading.set()
        release.wait(10)
        stored.append(part.index)

    queue = StoreQueue(upload, lambda p, e: None, lambda p, e: None, max_queued=2)
    queue.submit(PartToStore(0, 1, {}))
    assert uploading.wait(5)
    flushed: list[bool] = []
    flushing = threading.Thread(target=lambda: flushed.append(queue.flush(5)))
    flushing.start()
    queue.submit(PartToStore(0, 2, {}))
    queue.submit(PartToStore(0, 3, {}))  # replaces 2, still waiting
    flushing.join(0.3)
    assert flushed == [] and stored == []  # part 1 is still under way
    release.set()
    flushing.join(5)
    assert flushed == [True] and stored[0] == 1
    queue.close(5)
    assert stored == [1, 3]
