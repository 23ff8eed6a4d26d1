"""Pure decisions of the supervisor: what an event means, given the run's state. No Ray, no I/O:
the controller gathers the facts, calls these, and carries out what they return."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from elastic_train.config import ElasticConfig, FailureConfig, ScalingConfig
from elastic_train.protocol import Exit, PlaceRead, Position, ResumePlan
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus

if TYPE_CHECKING:
    from elastic_train.checkpoint.layout import CommittedCheckpoint
    from elastic_train.supervisor.checkpoints.ledger import ReportEntry


@dataclass(frozen=True)
class LastReport:
    """A running member's last report in the current generation."""

    worker_id: int
    index: int  # its last report index (the resume index until its first report)
    since: float  # when it made that report (or joined the generation)


@dataclass(frozen=True)
class Stall:
    """What to do about a generation in which no member reported for `progress_timeout_s`."""

    hung: tuple[int, ...] = ()  # members behind the others: hung; dropped and replaced
    restart: bool = False  # all stand at the same report: abort them all; whoever does not leave is hung


def stalled(progress: list[LastReport], now: float, timeout_s: float | None) -> Stall:
    """A member whose heartbeat thread is alive but whose loop is stuck (a deadlock, a hung kernel, a
    hung read) stops reporting. `report()` is a barrier, so the others soon stop too: the generation
    stalls. The hung members are those behind: the lowest last report index. When all stand at the
    same index (every rank stuck in one collective with the hung one), nobody can be told apart: the
    generation is aborted, and a member that does not leave within `drain_timeout_s` is dropped."""
    if timeout_s is None or not progress or now - max(p.since for p in progress) <= timeout_s:
        return Stall()
    lowest = min(p.index for p in progress)
    behind = tuple(sorted(p.worker_id for p in progress if p.index == lowest))
    if len(behind) == len(progress):
        return Stall(restart=True)
    return Stall(hung=behind)



class Do(str, enum.Enum):
    """What the supervisor does next."""

    WAIT = "wait"
    FINISH = "finish"  # every member's loop returned
    RESTART = "restart"  # leave the generation: abort the survivors' group, re-form from memory
    RESIZE = "resize"  # capacity for more workers: unwind at the next report, then re-form
    OPEN = "open"  # open the next generation with the candidates
    SCHEDULE = "schedule"  # below the minimum: wait for capacity
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    do: Do
    reason: str = ""
    failure: str | None = None  # a failure to count against FailureConfig.max_failures (its detail)
    dropped: tuple[int, ...] = ()  # members that did not leave an ended generation in time: hung


@dataclass(frozen=True)
class Member:
    """A member of the current generation, as the decisions see it."""

    worker_id: int
    rank: int
    exit: Exit | None = None  # how it left the generation; None while it runs (or once lost)
    lost: bool = False
    leaving: bool = False  # under a preemption notice: it leaves, it is no candidate
    detail: str = ""  # the traceback of a user error, or why it was lost

    @classmethod
    def of(cls, w: WorkerRecord) -> Member:
        lost = w.status is WorkerStatus.LOST
        return cls(w.worker_id, w.rank, exit=w.exited, lost=lost, leaving=w.leaving,
                   detail=w.lost_reason if lost else (w.outcome.detail if w.outcome else ""))


def to_store(decided: bool | None, *, stored_by_loop: bool, store: bool | None, carries_files: bool, sync: bool,
             due: Callable[[], bool]) -> bool | None:
    """Is a reported checkpoint stored, given a rank's report of it (None: not decided yet)? One the
    loop stored itself is; a live dict part is when one of its ranks found it due (`store`); a
    checkpoint of files is decided by its first report: a SYNC one waits for its commit, so it is
    stored whatever the cadence, any other when the cadence finds it `due()` (asked only then)."""
    if stored_by_loop:
        return True
    if store is not None:
        return True if store else decided
    if carries_files and decided is None:
        return sync or due()
    return decided


def resize_point(latest: int, loop_asks: bool) -> int | None:
    """Where members under a preemption notice leave the loop: the next report; or, when the loop
    asks `get_preemption_info()`, not yet (None): after the report following the call that tells it,
    where the loop saves a checkpoint, so no step is redone."""
    return None if loop_asks else latest + 1


def out_of_failures(failures: int, failure: FailureConfig) -> bool:
    """Have `failures` spent the run's budget (`max_failures`; -1: never)?"""
    return failure.max_failures != -1 and failures > failure.max_failures


def _user_error(members: list[Member], counted: bool) -> str | None:
    """A generation whose user code raised counts one failure, however many ranks raised: the same
    bug on every rank is one failure of the worker group, as Ray Train counts it."""
    raised = sorted((m for m in members if m.exit is Exit.USER_ERROR), key=lambda m: m.rank)
    return raised[0].detail if raised and not counted else None


def running(members: list[Member], *, resizing: bool, standby: int, scaling: ScalingConfig,
            failure: FailureConfig, error_counted: bool, in_place: bool = False) -> Decision:
    """The current generation runs (or unwinds for a resize): what its members' state means.
    `in_place`: the members that stay parked inside their loops, at one position: they go on even
    below the minimum (see `restarting`)."""
    exits = [m.exit for m in members if m.exit is not None]
    lost = [m for m in members if m.lost]
    if Exit.FINISHED in exits and all(m.exit is Exit.FINISHED or m.lost for m in members):
        return Decision(Do.FINISH)
    if Exit.USER_ERROR in exits:
        return Decision(Do.RESTART, "user code raised", failure=_user_error(members, error_counted))
    if lost or Exit.COLLECTIVE_ERROR in exits or (not resizing and any(e is not Exit.FINISHED for e in exits)):
        counted = f"worker {lost[0].worker_id} lost: {lost[0].detail}" if lost and failure.count_worker_loss else None
        return Decision(Do.RESTART, "worker lost" if lost else "collective failed", failure=counted)
    if resizing:
        if not all(e is Exit.UNWOUND for e in exits) or len(exits) < len(members):
            return Decision(Do.WAIT)
        staying = sum(not m.leaving for m in members) + standby
        if staying >= scaling.min_workers or (in_place and staying):
            return Decision(Do.OPEN, "resized")
        return Decision(Do.SCHEDULE, "below min workers once the leaving workers left")
    if standby and len(members) < scaling.min_workers <= len(members) + standby:
        # Below its size (its survivors went on while the replacement started): back at it now, every
        # loop re-entered from the newest checkpoint in memory, as Ray Train's restart at full size
        # would, rather than at the next report carrying a checkpoint (an epoch away, perhaps).
        return Decision(Do.RESTART, f"{standby} replacement(s) ready: back at {scaling.min_workers} workers")
    if standby and len(members) < scaling.max_workers:
        return Decision(Do.RESIZE, f"{standby} worker(s) ready to join")
    return Decision(Do.WAIT)


def restarting(members: list[Member], *, parked: int, waited_s: float, drain_timeout_s: float,
               scaling: ScalingConfig, error_counted: bool, in_place: bool = False) -> Decision:
    """The generation ended: wait for its survivors to leave it, then re-form. `parked` counts the
    workers ready for the next generation (survivors and newcomers, none under a notice); `in_place`:
    they are survivors that can go on in place. Those go on even below the minimum (a fixed-size
    run's replacement is still starting): the run grows back once it is ready, rather than stall."""
    drained = _drained(members, waited_s, drain_timeout_s)
    if drained is None:
        return Decision(Do.WAIT)
    do = Do.OPEN if parked >= scaling.min_workers or (in_place and parked) else Do.SCHEDULE
    reason = drained.reason or ("going on below the minimum while a replacement starts"
                                if do is Do.OPEN and parked < scaling.min_workers else "")
    return dataclasses.replace(drained, do=do, reason=reason, failure=_user_error(members, error_counted))


def stopping(members: list[Member], *, waited_s: float, drain_timeout_s: float) -> Decision:
    """A stop was asked and the generation ended: finish once its members have left it (those still
    in after `drain_timeout_s` are dropped)."""
    drained = _drained(members, waited_s, drain_timeout_s)
    return Decision(Do.WAIT) if drained is None else dataclasses.replace(drained, do=Do.FINISH)


def _drained(members: list[Member], waited_s: float, drain_timeout_s: float) -> Decision | None:
    """None while members are still leaving the ended generation; then a decision (its `do` to be
    set) that drops those still in after `drain_timeout_s`."""
    still_in = tuple(m.worker_id for m in members if m.exit is None and not m.lost)
    if still_in and waited_s <= drain_timeout_s:
        return None
    reason = f"did not leave the generation within drain_timeout_s={drain_timeout_s}s" if still_in else ""
    return Decision(Do.WAIT, reason, dropped=still_in)


def scheduling(*, parked: int, starting: int, first: bool, expected_initial: int, waited_s: float,
               scaling: ScalingConfig, elastic: ElasticConfig) -> Decision:
    """No generation runs: open one once enough workers are ready, or fail after the wait allowed."""
    placed = parked >= scaling.max_workers or (not starting and (not first or parked >= expected_initial))
    if parked >= scaling.min_workers and (placed or waited_s > elastic.initial_placement_timeout_s):
        return Decision(Do.OPEN)
    if waited_s > elastic.min_workers_timeout_s:
        return Decision(Do.FAIL, (
            f"only {parked + starting} of the minimum {scaling.min_workers} workers could be placed within "
            f"min_workers_timeout_s={elastic.min_workers_timeout_s}s. Add capacity to the cluster, lower "
            "ScalingConfig.num_workers, or raise ElasticConfig.min_workers_timeout_s."))
    return Decision(Do.WAIT)


# -- checkpoints: where a generation resumes, what is stored as the run ends ---------------------
def resume_from(in_memory: ResumePlan | None, stored: CommittedCheckpoint | None) -> ResumePlan | None:
    """The newest checkpoint there is: served from survivors' memory (`in_memory`) when it is at least
    as new as storage's newest, else loaded from storage; None when there is neither."""
    if stored is None or (in_memory is not None and in_memory.index >= stored.index):
        return in_memory
    return ResumePlan(index=stored.index, stored=stored, loader_states=stored.loader_states)


def in_place(positions: list[Position | None], ranks: list[int]) -> Position | None:
    """Where the next generation's members go on without leaving their loops: each member's position
    (None: a newcomer, or a survivor that left its loop) and rank in the generation that ends. Only
    when every member is a survivor that parked inside its loop at one position: a newcomer has no
    state to go on from mid-step, and survivors at different steps would reduce different steps'
    gradients together. A broadcast (or reduce) from rank 0 is made again only if rank 0 survived:
    another rank's input to it is what it was to receive."""
    if not positions or any(p is None for p in positions) or len(set(positions)) != 1:
        return None
    if positions[0].at == "rooted" and 0 not in ranks:
        return None
    return positions[0]


_NAMES = {"rank": "rank", "world_size": "world size", "local_rank": "local rank",
          "local_world_size": "local world size", "node_rank": "node rank"}


def unfaithful(reads: Sequence[Sequence[PlaceRead]], places: Sequence[Mapping[str, int]]) -> str | None:
    """Why going on in place would change what the loops compute: each member's reads of its place
    (faithful/reads.py) against its place in the next generation, in the same order. Ray Train re-runs
    the loop at every new world, so a value the loop holds from the old one (a batch size from the
    world size, a rank read once), or used in the step that failed (a loss divided by the world size
    before its all-reduce), would be computed afresh there: where the new place changes one, the loop
    is re-entered, as Ray's is. None: nothing the loops read changes (a rank that keeps its number)."""
    for member, place in zip(reads, places):
        for read in member:
            if read.what == "combined":  # faithful/combines.py: a collective after the loop's steps
                return (f"{read.site} combines, after the steps it stands in, what each rank kept across them "
                        "(a lost rank's share would be missing)")
            if read.what == "epoch_steps":  # len() of a prepared loader: going on mid-epoch changes it
                return f"{read.site} holds the epoch's length it read ({read.value} steps), which going on would change"
            now = place.get(read.what)
            if now is not None and now != read.value:
                how = "holds the" if read.held else "used, in the step the peer was lost in, the"
                return f"{read.site} {how} {_NAMES.get(read.what, read.what)} it read ({read.value}, now {now})"
    return None


def newcomers_join(at: Position, newest: int | None, back_at_size: bool = False) -> bool:
    """Do newcomers join survivors that could go on in place at `at`? Where the newest checkpoint was
    made at the survivors' last report and no step was completed since (`at.steps == 0`): every loop
    re-enters from it at the larger size, as Ray Train's restart at the size it finds does, and the
    survivors lose at most the step they were in (a warm spare is back in the run at the loss, not at
    a second re-formation). And where they bring a run below its minimum back to it (`back_at_size`):
    every loop re-enters from the newest checkpoint. Otherwise the survivors go on alone, and the
    newcomers join at a report that carries a checkpoint (joining survivors past their last checkpoint
    would make them redo the steps since)."""
    return (newest == at.index and at.steps == 0) or back_at_size


def hopeless(entry: ReportEntry | None, generation: int, *, current_generation: int, live: set[int],
             members: Mapping[int, int], replaceable: bool) -> bool:
    """Can checkpoint `entry`, reported in `generation`, no longer commit? Its generation rewound past
    it (no entry, or another generation's), a part was given up, a worker that had to store a part is
    gone (or, for one the loop stored itself, every rank that reported it stored), or, under a cadence
    that replaces waiting uploads, a newer generation's checkpoint replaced it before its upload.
    `live`: the workers alive; `members`: the current generation's worker id by rank."""
    if entry is None or entry.generation != generation or entry.given_up or entry.uploader_lost(live):
        return True
    registrars = {members[rank] for rank in entry.stored_by_ranks if rank in members}
    if entry.stored_by_loop and not entry.stored and not registrars & live:
        return True
    return replaceable and generation < current_generation and not entry.stored


def final_flush(newest: ResumePlan | None, stored_index: int, entry: ReportEntry | None, *,
                live: set[int], failed: bool) -> ResumePlan | None:
    """What the workers store as the run ends: the newest checkpoint they hold (`newest`), if storage
    has nothing of it (`stored_index`: its newest committed) and it is on no way there (`entry`
    neither committed nor stored by a worker, or an uploader of it was lost before it told its part
    stored; a failed run's is stored whatever); never a state kept for recovery alone. `live`: the
    workers alive."""
    if newest is None or newest.index <= stored_index or newest.state_only:
        return None
    storing = entry is not None and (entry.committed or (bool(entry.stored) and not entry.left_to_holders(live)))
    return newest if failed or not storing else None


class HandOver(str, enum.Enum):
    """What workers leaving under a preemption notice do with the checkpoint a new generation resumes from."""

    NOTHING = "nothing"  # the staying workers hold it already (or it is a kept state nobody stores)
    MOVE = "move"  # they hand what only they hold of it to a staying worker
    STORE = "store"  # nobody stays: they store it before they go


def hand_over(whole: ResumePlan | None, kept: ResumePlan | None, *, anyone_stays: bool) -> HandOver:
    """`whole`: the newest checkpoint the leaving and staying workers hold together; `kept`: the
    newest the staying ones hold alone."""
    if whole is None or (kept is not None and kept.index >= whole.index):
        return HandOver.NOTHING
    if anyone_stays:
        return HandOver.MOVE
    return HandOver.NOTHING if whole.state_only else HandOver.STORE
