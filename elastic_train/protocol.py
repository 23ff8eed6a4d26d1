"""Messages between workers and the supervisor. Plain dataclasses: Ray pickles them; heartbeats also
travel as UDP datagrams (`Beat`, `BeatReply`: fixed binary layouts, packed here)."""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ray import cloudpickle


class RunState(str, enum.Enum):
    """The run's state, as the supervisor moves it (supervisor/state.py: the transitions) and as its
    summary records it (run_folder/summary.py)."""

    ADOPTING = "ADOPTING"
    SCHEDULING = "SCHEDULING"
    RUNNING = "RUNNING"
    RESIZING = "RESIZING"
    RESTARTING = "RESTARTING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.ERRORED)

    @property
    def training(self) -> bool:
        """A generation is open and its members in their loop."""
        return self in (RunState.RUNNING, RunState.RESIZING)


class Exit(str, enum.Enum):
    """Why a worker left a generation and parked at the supervisor."""

    JOINED = "joined"  # a new worker, ready for its first generation
    FINISHED = "finished"  # the user's loop returned
    UNWOUND = "unwound"  # left at a report boundary, or its generation ended
    COLLECTIVE_ERROR = "collective_error"  # a torch.distributed operation failed
    USER_ERROR = "user_error"  # the user's code raised


@dataclass(frozen=True)
class Position:
    """Where a survivor's loop stands when it parks inside it: `steps` gradient reductions after report
    `index`, then `calls` collectives on the default group (worker/group/world.py), in the collective
    `at` names ("gradients": the step's reduction; "ddp": one of DDP's own; "collective": one of the
    loop's, "rooted" if it is a broadcast or reduce from rank 0; "report": report `index`'s barrier;
    "leave": past it, every rank leaving the group there).
    Survivors at one position may go on in place (worker/loop/session.py `go_on_in_place`)."""

    index: int
    steps: int = 0
    at: str = "gradients"
    calls: int = 0


@dataclass(frozen=True)
class PlaceRead:
    """A read of its place the loop made (faithful/reads.py): `what` ("rank", "world_size",
    "local_rank", "local_world_size", "node_rank"; "epoch_steps", a prepared loader's length;
    "combined", a collective after its steps: faithful/combines.py) was `value` at `site` (file:line,
    `text` its statement); `held`: the statement keeps the value, else it was used where read in the
    step under way."""

    site: str
    what: str
    value: int
    held: bool
    text: str = ""


@dataclass
class Outcome:
    exit: Exit
    generation: int = -1
    detail: str = ""  # the traceback for USER_ERROR / COLLECTIVE_ERROR
    held: list[HeldCheckpoint] = field(default_factory=list)  # the parts and replicas it holds, with their facts
    error: bytes | None = None  # USER_ERROR: the exception, pickled by the worker (None if it could not be)
    returned: bytes | None = None  # FINISHED on rank 0: what the loop returned, pickled (Result.return_value)
    # A report whose barrier failed after its step made a collective with every peer; this worker holds
    # its live dict part (worker/report/lockstep.py `_keep_unagreed`), which the next generation may resume from.
    unagreed: Report | None = None
    # Still inside its loop, which goes on from here if the next generation re-forms in place.
    in_place: Position | None = None
    reads: tuple[PlaceRead, ...] = ()  # what the loop holds of its place (supervisor/policy.py `unfaithful`)

    @classmethod
    def user_error(cls, generation: int, exc: BaseException, detail: str, exit: Exit = Exit.USER_ERROR) -> "Outcome":
        """The user's code raised `exc`: it travels pickled, its traceback text attached as a note, so
        that `fit()` raises it again with the worker's traceback; an exception that cannot be pickled
        travels as a RuntimeError that holds the traceback."""
        exc.add_note(detail)
        try:
            error = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001 - any object may sit in an exception's args
            error = None
        return cls(exit, generation, detail, error=error)

    @classmethod
    def finished(cls, generation: int, returned: Any) -> "Outcome":
        """The loop returned `returned` (kept when not None: rank 0's becomes `Result.return_value`)."""
        if returned is None:
            return cls(Exit.FINISHED, generation)
        try:
            pickled = cloudpickle.dumps(returned)
        except Exception as exc:  # noqa: BLE001 - any object may be returned
            raise TypeError(f"train_loop_per_worker returned a {type(returned).__name__}, which cannot be pickled: "
                            "return a picklable value (it becomes Result.return_value) or None.") from exc
        return cls(Exit.FINISHED, generation, returned=pickled)

    def raised(self) -> BaseException:
        """The exception of a USER_ERROR, as the user's code raised it."""
        if self.error is not None:
            try:
                return cloudpickle.loads(self.error)
            except Exception:  # noqa: BLE001 - its class may not load here
                pass
        return RuntimeError(self.detail)


@dataclass
class ResumePlan:
    """Where a new generation's `get_checkpoint()` comes from."""

    index: int  # the report index of the checkpoint; the loop's reports go on from here
    holders: dict[int, list[str]] = field(default_factory=dict)  # worker id -> files it serves from memory
    stored: Any = None  # the CommittedCheckpoint in storage to load, when no survivor holds a newer one
    loader_states: list[dict[str, Any]] = field(default_factory=list)  # prepare_data_loader positions
    generation: int = -1  # the generation that reported it
    # Chosen to be stored, but its barrier failed before any rank stored it, or a rank that was to store
    # its part was lost before it told it stored: its holders store it.
    store: bool = False
    dir_name: str | None = None  # the folder its report named, to store it in
    # The state a run keeps live for recovery (`prepare_model(model, live_state=True)`): restored into
    # the model and its optimizer, never stored, not a checkpoint for `get_checkpoint()`.
    state_only: bool = False
    # name -> {"size", "xxh3_128"} of the copy its holder serves, as made when reported (or serialized):
    # checked where it lands. A kept state has none (its tensors' versions are its check).
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Assignment:
    """A worker's place in a generation."""

    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    resume: ResumePlan | None
    peers: dict[int, Any]  # worker id -> actor handle of the members (to fetch checkpoint files)
    buddy: Any = None  # the peer that keeps a replica of this worker's checkpoint parts (None: no replicas)
    max_world_size: int = 1  # ScalingConfig's max: the world size may change under the loop when > 1
    # In place: the members' loops go on where they stand, and this is each one's rank in the previous
    # generation, by its new rank. None: the loop is entered afresh and resumes from `resume`.
    previous_ranks: tuple[int, ...] | None = None


@dataclass
class Stop:
    """The run is over for this worker."""

    reason: str
    flush: ResumePlan | None = None  # store this worker's files of this checkpoint before leaving


@dataclass(frozen=True)
class HeartbeatChannel:
    """Where a worker sends its heartbeats as UDP datagrams (supervisor/heartbeats.py). The token is
    the supervisor's own: a datagram of another run, or for a supervisor Ray has since restarted, is
    dropped."""

    host: str  # the supervisor's node address
    port: int
    node_id: str  # the supervisor's node: a worker on it sends to 127.0.0.1
    token: bytes  # TOKEN_BYTES random bytes


@dataclass
class HeartbeatReply:
    active_generation: int | None  # None while the supervisor is re-forming the group
    fenced: bool = False  # this worker was dropped from its generation
    channel: HeartbeatChannel | None = None  # on a reply through Ray: where to send the next ones (None: through Ray)


TOKEN_BYTES = 16
_NONE = -1  # a generation of None on the wire (generations count from 0)
_BEAT = struct.Struct(f"!4s{TOKEN_BYTES}sIIidfi")  # magic, token, worker id, seq, generation, RSS, CPU %, report index
_REPLY = struct.Struct(f"!4s{TOKEN_BYTES}sIIi?")  # magic, token, worker id, seq, active generation, fenced
_BEAT_MAGIC, _REPLY_MAGIC = b"ETb2", b"ETr1"


class Beat(NamedTuple):
    """A heartbeat datagram: a worker alive, the generation it runs (None: parked), its process facts,
    and the newest report its loop entered in that generation (-1: none known)."""

    token: bytes
    worker_id: int
    seq: int  # the worker's count of heartbeats: its reply carries it back
    generation: int | None
    rss_bytes: float
    cpu_percent: float
    report_index: int = -1

    def pack(self) -> bytes:
        return _BEAT.pack(_BEAT_MAGIC, self.token, self.worker_id, self.seq,
                          _NONE if self.generation is None else self.generation, self.rss_bytes, self.cpu_percent,
                          self.report_index)

    @classmethod
    def unpack(cls, data: bytes) -> "Beat | None":
        """The beat in `data`; None for anything else (a stray or truncated datagram)."""
        if len(data) != _BEAT.size or not data.startswith(_BEAT_MAGIC):
            return None
        _, token, worker_id, seq, generation, rss, cpu, index = _BEAT.unpack(data)
        return cls(token, worker_id, seq, None if generation == _NONE else generation, rss, cpu, index)


class BeatReply(NamedTuple):
    """The supervisor's answer to a `Beat`: a `HeartbeatReply` for that beat."""

    token: bytes
    worker_id: int
    seq: int
    reply: HeartbeatReply

    def pack(self) -> bytes:
        active = self.reply.active_generation
        return _REPLY.pack(_REPLY_MAGIC, self.token, self.worker_id, self.seq, _NONE if active is None else active,
                           self.reply.fenced)

    @classmethod
    def unpack(cls, data: bytes) -> "BeatReply | None":
        if len(data) != _REPLY.size or not data.startswith(_REPLY_MAGIC):
            return None
        _, token, worker_id, seq, active, fenced = _REPLY.unpack(data)
        return cls(token, worker_id, seq, HeartbeatReply(None if active == _NONE else active, fenced))


class Pace(NamedTuple):
    """How a worker's loop went, sent with each report (supervisor/watch/pace.py, supervisor/watch/metrics.py)."""

    step_s: float  # the loop's time since its last report, outside report() and other barriers
    rss: float  # the process's resident memory, bytes
    stall_s: float  # how long its previous report() held the loop (0.0 at a generation's first)


@dataclass
class Report:
    """One `report()` of a worker, as the supervisor records it."""

    generation: int
    index: int
    metrics: dict[str, Any]
    names: list[str] | None  # the files of its checkpoint part; None: no checkpoint
    loader_states: list[dict[str, Any]]
    dir_name: str | None = None  # the folder the loop named (`checkpoint_dir_name`)
    stored_by_loop: bool = False  # the loop stored the checkpoint itself (NO_UPLOAD)
    sync: bool = False  # SYNC: stored whatever the cadence
    pace: Pace | None = None
    # A live dict part: whether its rank found it due to be stored (never a kept state's); None: the cadence's call.
    store: bool | None = None
    # The ranks that reported a checkpoint part here, as its barrier agreed (None: none did, or unknown):
    # a rank that died with this report on its way then took no part of it with it.
    part_ranks: list[int] | None = None
    # A peer's report, whose part this worker received at this report's barrier (worker/report/part_exchange.py).
    peer: PeerReport | None = None


@dataclass
class PartStored:
    """A worker stored its part of checkpoint `index` of `generation`, in `upload_s` (worker/store/worker_store.py).
    Sent after its report, in the same stream (worker/report/sender.py): no call of its own."""

    generation: int
    index: int
    facts: dict[str, dict[str, Any]]  # of the stored files
    upload_s: float


@dataclass
class PeerReport:
    """A peer's report, as the buddy that its part went to at the report's barrier holds it. Should
    the peer die with its own report on the way, the buddy's report brings this one: the barrier
    passed, so the peer made it."""

    worker_id: int
    rank: int
    report: Report
    facts: dict[str, dict[str, Any]]  # of the part's files, as made with their bytes


@dataclass
class ReportReply:
    accepted: bool  # False for a stale generation: the worker is fenced
    unwind: bool = False  # leave the loop after this report: the group is being resized
    store: bool = False  # this checkpoint is stored (the store cadence chose it)
    store_part: bool = False  # this worker stores its part (a dict checkpoint several ranks reported: the lowest rank)
    replaceable: bool = True  # a newer checkpoint may replace it before its upload starts
    dir_name: str | None = None  # the folder the report named (the first rank's `checkpoint_dir_name`)
    list_stored: bool = False  # list the checkpoint the loop stored itself (NO_UPLOAD) and report it stored


@dataclass
class HeldCheckpoint:
    """A checkpoint part a worker holds in memory, as it was reported."""

    index: int
    generation: int
    rank: int
    names: list[str]
    loader_states: list[dict[str, Any]]  # prepare_data_loader positions (global: alike on every rank)
    # name -> {"size", "xxh3_128"}, made with the files' bytes (at the report; a live part's when serialized)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class WorkerInfo:
    """What a worker tells a restarted supervisor about itself, so that it can be adopted."""

    worker_id: int
    node_id: str
    ip: str
    pid: int
    generation: int  # the generation it last ran in (-1: none yet)
    rank: int  # its rank in that generation
    world_size: int
    index: int  # the last report index it reached in that generation
    running: bool  # still in the loop of that generation (not parked)
    held: list[HeldCheckpoint] = field(default_factory=list)
    bundle: str = ""  # the id of the placement group it runs in ('': none, a spare that took a bundle over)


@dataclass(frozen=True)
class PreemptionInfo:
    """An imminent preemption (Ray Train's `ray.train.PreemptionInfo`): what `get_preemption_info()`
    returns on every rank alike once a notice is known."""

    deadline_ms: int | None  # the earliest reclaim deadline (UNIX time in ms) of the preempted nodes, if known
    preempted_node_to_ranks: dict[str, list[int]]  # node id -> the world ranks it runs

    @property
    def preempted_node_ids(self) -> list[str]:
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})


@dataclass
class ReportRecord:
    """One report every rank made, for the driver's callbacks: delivered in order, once its checkpoint
    is settled (committed, or known never to be)."""

    index: int
    generation: int
    world_size: int
    metrics: list[dict[str, Any]]  # by world rank
    checkpoint: Any = None  # the CommittedCheckpoint, when this report's checkpoint was committed
    time: float | None = None  # when every rank had made it (time.time())


@dataclass
class Feed:
    """What `Supervisor.feed` returns: the reports and events since the driver's cursors."""

    reports: list[ReportRecord]
    events: list[dict[str, Any]]
    report_cursor: int
    event_cursor: int
    over: bool  # the run has ended: nothing more will come
    incarnation: str = ""  # the supervisor's: a restarted one feeds from the start again (the cursors were its predecessor's)
