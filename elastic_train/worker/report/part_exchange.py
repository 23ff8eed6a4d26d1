"""A small checkpoint part goes to its buddy inside the report, over the group the loop trains on.

Why: a report returns once its part is safe beyond its process, so that a worker lost as its report
returns takes no step with it (`ElasticConfig.part_safe_wait_s`). Copied by a Ray call in the
background, a 0.13 MB part took 3-6 ms to land, and its CPU slowed the next step (benchmarks/RESULTS.md).
At the report's barrier every rank is already waiting. So a part of files of up to `EXCHANGED_BYTES`
goes to the next rank, the buddy, as one point-to-point message of the generation's gloo group
(~0.1 ms here). Its report goes with it: should its rank die with its own report on the way, the
buddy's report brings it (protocol.py `PeerReport`).

The barrier's all-reduce tells every rank how many bytes each sends (`Agreed.sends`), so a buddy
posts its receive at once. Parts are exchanged only at a report where every rank waits for the
barrier (after a report with a checkpoint, say): one where peers went on before it passed
(worker/report/barrier.py `goes_on`) has no buddy to receive. Those, larger parts, live ones, and those of
NCCL runs are copied in the background (worker/hold/replicator.py).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
from ray import cloudpickle

from elastic_train.checkpoint.checkpoint import DICT_PART_NAMES
from elastic_train.checkpoint.manifest import facts_made
from elastic_train.protocol import HeldCheckpoint, PeerReport, Report
from elastic_train.worker.group.world import generation_group
from elastic_train.worker.report.barrier import Agreed

logger = logging.getLogger(__name__)

EXCHANGED_BYTES = 1 << 20  # a part up to this size goes in the report; below it a copy's fixed cost dominates
_TAG = 7301  # apart from the tags the loop's own point-to-point messages may use

Part = tuple[PeerReport, dict[str, bytes]]  # a peer's report, and its part's files


def outgoing(worker_id: int, report: Report, files: dict[str, bytes] | None,
             facts: Future[dict[str, dict[str, Any]]] | None) -> torch.Tensor | None:
    """This rank's part and report as they go to its buddy; None where the part goes otherwise: none,
    a large one, or one named as a dict part's (not copied where every rank holds one). Made before
    the barrier: its size goes into the all-reduce."""
    if files is None or set(files) <= DICT_PART_NAMES or sum(len(data) for data in files.values()) > EXCHANGED_BYTES:
        return None
    buffer = io.BytesIO()
    # The receiver stamps what the barrier may still change (generation, rank, part_ranks): a report
    # made again in a group re-formed in place sends these same bytes. As Ray would: metrics may be any object.
    cloudpickle.dump((PeerReport(worker_id, -1, report, facts_made(files, facts) or {}), files), buffer)
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def exchange(agreed: Agreed, payload: torch.Tensor | None, report: Report) -> tuple[Sending | None, Part | None]:
    """Start sending `payload` (`outgoing`) to the next rank, and receive the previous rank's part,
    stamped as the part of `report`'s barrier: (what is on its way, the part received). Raises what a
    failed collective raises."""
    group = generation_group()
    rank, size = group.rank(), group.size()
    sending = Sending(group.send([payload], (rank + 1) % size, _TAG), payload) if agreed.sends[rank] else None
    peer = (rank - 1) % size
    if not agreed.sends[peer]:
        return sending, None
    received = torch.empty(agreed.sends[peer], dtype=torch.uint8)
    group.recv([received], peer, _TAG).wait()
    sent, files = pickle.loads(memoryview(received.numpy()))
    stamped = dataclasses.replace(sent.report, generation=report.generation, part_ranks=report.part_ranks)
    return sending, (dataclasses.replace(sent, rank=peer, report=stamped), files)


class Sending:
    """This rank's part on its way to the buddy: the report waits for it after its other work."""

    def __init__(self, work: dist.Work, payload: torch.Tensor):
        self._work, self._payload = work, payload  # the payload's buffer stays alive until sent

    def wait(self) -> None:
        """Until it is out of this process; raises what a failed collective raises."""
        self._work.wait()


class PartExchange:
    """A session's side of the exchanges: what it sends, what it keeps of its peer's, when it is sent."""

    def __init__(self, worker_id: int, hold_replica: Callable[[HeldCheckpoint, dict[str, bytes]], None]):
        self._worker_id, self._hold_replica = worker_id, hold_replica
        self._sending: Sending | None = None  # this report's part on its way to the buddy

    def outgoing(self, report: Report, files: dict[str, bytes] | None,
                 facts: Future[dict[str, dict[str, Any]]] | None, buddy_waits: bool) -> torch.Tensor | None:
        """This rank's part as it goes to its buddy (`outgoing`), if it has one that waits at this
        report's barrier (a rank that went on before it passed would never receive it)."""
        return outgoing(self._worker_id, report, files, facts) if buddy_waits else None

    def exchange(self, agreed: Agreed, report: Report, payload: torch.Tensor | None) -> bool:
        """Every rank, once the barrier passed: send `payload`, and keep the previous rank's part as a
        replica, its report as `report.peer`. Is this rank's on its way? Not if a peer was lost
        meanwhile: the part is then copied in the background, as a large one is."""
        if not any(agreed.sends):
            return False
        try:
            self._sending, received = exchange(agreed, payload, report)
        except RuntimeError as exc:  # a lost peer: the generation is over, the next collective says so
            logger.info("report %d: checkpoint parts not exchanged with the buddies: %s", report.index, exc)
            return False
        if received is not None:
            peer, files = received
            self._hold_replica(HeldCheckpoint(peer.report.index, peer.report.generation, peer.rank,
                                              peer.report.names or [], peer.report.loader_states, peer.facts), files)
            report.peer = peer
        return self._sending is not None

    def sent(self, index: int) -> None:
        """Wait until report `index`'s part is out of the process: as report() returns, it is safe."""
        sending, self._sending = self._sending, None
        if sending is not None:
            try:
                sending.wait()
            except RuntimeError as exc:  # the buddy is lost: the generation is over, the next collective says so
                logger.info("report %d: checkpoint part not sent to the buddy: %s", index, exc)
