"""The run's events, typed: one frozen dataclass per kind.

The supervisor records these; its observers (the event log, which the driver's feed reads, and the
exported metrics) receive them as values. On the wire and in `events.jsonl` an event is a flat dict — its
`kind`, its fields, and the time it was recorded (`t` since the run began, `time` since the epoch) —
and readers get the typed value back with `Kind.of(entry)` instead of taking the dict apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

E = TypeVar("E", bound="Event")
KINDS: dict[str, type[Event]] = {}
DETAIL = {"detail": True}  # a field's metadata: left out of the dict form when None


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        KINDS[cls.kind] = cls

    def entry(self, t: float, time: float) -> dict[str, Any]:
        """The flat dict form, stamped with when it was recorded."""
        return {"t": t, "time": time, "kind": self.kind,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if not (f.metadata.get("detail") and getattr(self, f.name) is None)}}

    @classmethod
    def of(cls: type[E], entry: Mapping[str, Any]) -> E | None:
        """The typed event of a dict entry of this kind; None for an entry of another kind. A field
        the entry lacks (a log written by an older version) is None, or its default."""
        if entry.get("kind") != cls.kind:
            return None
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return cls(**{f.name: entry.get(f.name) for f in dataclasses.fields(cls)
                      if f.name in entry or f.name in required})


class EventObserver(Protocol):
    """What hears every event the supervisor records (the event log, the exported metrics)."""

    def on_event(self, event: Event, entry: dict[str, Any], now: float) -> None:
        """`event` was recorded as `entry`, at monotonic time `now`."""


# -- the run and its states ----------------------------------------------------------------------
@dataclass(frozen=True)
class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    expected_workers: int


@dataclass(frozen=True)
class SupervisorRestarted(Event):
    kind: ClassVar[str] = "supervisor_restarted"
    adopted: list[int]
    generation: int
    members: dict[int, int]  # worker id -> rank
    index: int


@dataclass(frozen=True)
class StateChanged(Event):
    kind: ClassVar[str] = "state"
    source: str
    target: str
    reason: str | None = field(default=None, metadata=DETAIL)
    generation: int | None = field(default=None, metadata=DETAIL)
    world_size: int | None = field(default=None, metadata=DETAIL)
    at: str | None = field(default=None, metadata=DETAIL)


@dataclass(frozen=True)
class GenerationOpened(Event):
    kind: ClassVar[str] = "generation"
    generation: int
    world_size: int
    members: dict[int, dict[str, Any]]  # worker id -> its rank, pid and node
    resume_index: int | None = None  # None: from the start, or adopted by a restarted supervisor
    resume_from: str | None = None  # "in place" (the loops went on where they stood), "memory", "storage", or None
    adopted: bool = False
    # Survivors could have gone on in place, but the loop holds what the new place changes: it was
    # re-entered, as Ray Train's is ("train.py:23 holds the world size it read (3, now 2)"; policy.unfaithful).
    reentered_because: str | None = None


@dataclass(frozen=True)
class ResizeRequested(Event):
    kind: ClassVar[str] = "resize_requested"
    at_report: int | None
    reason: str


@dataclass(frozen=True)
class Failure(Event):
    kind: ClassVar[str] = "failure"
    count: int
    max_failures: int
    detail: str
    worker_failures: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StopRequested(Event):
    kind: ClassVar[str] = "stop_requested"
    reason: str


@dataclass(frozen=True)
class RunEnded(Event):
    kind: ClassVar[str] = "run_ended"
    state: str


# -- workers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerLost(Event):
    """A worker the supervisor gave up on; it is fenced."""

    kind: ClassVar[str] = "worker_lost"
    worker_id: int
    pid: int
    rank: int
    node_id: str
    generation: int
    cause: str
    reason: str = ""
    spare: bool = False  # a warm spare, which had no place in the run yet: not counted in `workers_lost`


@dataclass(frozen=True)
class WorkerLeft(Event):
    """A worker that left under a preemption notice, out of an ended generation."""

    kind: ClassVar[str] = "worker_left"
    worker_id: int
    pid: int
    rank: int
    node_id: str
    generation: int
    cause: str


@dataclass(frozen=True)
class WorkerReady(Event):
    """A new worker (a replacement, or one a node added) is ready for a place: its warm-up done."""

    kind: ClassVar[str] = "worker_ready"
    worker_id: int
    pid: int
    node_id: str


LOST_KINDS = (WorkerLost.kind, WorkerLeft.kind)  # a worker leaving the run, with its `cause`


@dataclass(frozen=True)
class FencedHeartbeat(Event):
    kind: ClassVar[str] = "fenced_heartbeat"
    worker_id: int
    pid: int
    generation: int | None


@dataclass(frozen=True)
class FencedWorkerRejoined(Event):
    kind: ClassVar[str] = "fenced_worker_rejoined"
    worker_id: int
    pid: int
    old_generation: int


@dataclass(frozen=True)
class PreemptionNotice(Event):
    kind: ClassVar[str] = "preemption_notice"
    worker_id: int
    pid: int
    rank: int
    node: str
    source: str
    seconds_left: float | None


@dataclass(frozen=True)
class Straggler(Event):
    kind: ClassVar[str] = "straggler"
    index: int
    worker_id: int
    rank: int | None
    node_id: str | None
    step_s: float
    median_step_s: float
    reports: int


@dataclass(frozen=True)
class StragglerCleared(Event):
    kind: ClassVar[str] = "straggler_cleared"
    index: int
    worker_id: int
    step_s: float


@dataclass(frozen=True)
class MemoryGrowing(Event):
    kind: ClassVar[str] = "memory_growing"
    index: int
    worker_id: int
    rank: int | None
    rss_mb: float
    reports: int


# -- reports ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaleReportRejected(Event):
    kind: ClassVar[str] = "stale_report_rejected"
    worker_id: int
    pid: int
    generation: int
    index: int
    current_generation: int


@dataclass(frozen=True)
class ReportUnagreedKept(Event):
    kind: ClassVar[str] = "report_unagreed_kept"
    worker_id: int
    rank: int
    generation: int
    index: int


@dataclass(frozen=True)
class ReportWaitedForUpload(Event):
    kind: ClassVar[str] = "report_waited_for_upload"
    worker_id: int
    index: int
    waited_s: float


# -- checkpoints -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointCommitted(Event):
    kind: ClassVar[str] = "checkpoint_committed"
    index: int
    generation: int
    files: int
    bytes: int
    commit_s: float


@dataclass(frozen=True)
class CommitRefused(Event):
    kind: ClassVar[str] = "commit_refused"
    index: int
    generation: int
    reason: str


@dataclass(frozen=True)
class CommitGivenUp(Event):
    kind: ClassVar[str] = "commit_given_up"
    index: int
    reason: str


@dataclass(frozen=True)
class StoreGivenUp(Event):
    """A worker could not store its part before the retry deadline."""

    kind: ClassVar[str] = "store_given_up"
    worker_id: int
    index: int
    reason: str


@dataclass(frozen=True)
class StorageFailed(Event):
    kind: ClassVar[str] = "storage_failed"
    worker_id: int
    message: str


@dataclass(frozen=True)
class CheckpointCorrupt(Event):
    """A committed checkpoint in storage whose files do not verify (removed)."""

    kind: ClassVar[str] = "checkpoint_corrupt"
    index: int
    path: str
    problems: list[str]


@dataclass(frozen=True)
class CheckpointCopyCorrupt(Event):
    """A copy held in a worker's memory that is not what its report made."""

    kind: ClassVar[str] = "checkpoint_copy_corrupt"
    worker_id: int
    holder: int
    generation: int
    index: int
    name: str
    problem: str


@dataclass(frozen=True)
class RestoredFromStorage(Event):
    kind: ClassVar[str] = "restored_from_storage"
    index: int
    path: str


@dataclass(frozen=True)
class CheckpointHandedOver(Event):
    kind: ClassVar[str] = "checkpoint_handed_over"
    source: int
    target: int
    index: int
    names: list[str]
