"""What one `report()` does, decided from plain facts: `plan_report` before its barrier, `after_barrier`
once every rank's flags are known. The session (worker/loop/session.py) applies the plans; they are pure, so
each rule is tested without Ray or a process group (tests/test_report_plan.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elastic_train.checkpoint.checkpoint import DICT_PART_NAMES
from elastic_train.checkpoint.modes import CheckpointUploadMode
from elastic_train.worker.report.barrier import Agreed, all_wait, goes_on


class Carries(str, enum.Enum):
    """What a report holds besides its metrics."""

    NOTHING = "nothing"  # metrics alone
    FILES = "files"  # the checkpoint's files, read at the report
    LIVE = "live"  # a dict checkpoint held as its live tensors (worker/hold/live_part.py)
    KEPT = "kept"  # no checkpoint: the state kept live for recovery (worker/hold/kept_state.py), never stored
    LOOP_STORED = "loop_stored"  # NO_UPLOAD: a checkpoint the loop stored itself, named by its folder


@dataclass(frozen=True)
class ReportPlan:
    """A report's course before its barrier."""

    carries: Carries
    mode: CheckpointUploadMode  # NO_UPLOAD once the user's upload_fn stored it
    decide: bool  # a checkpoint the supervisor decides on (its storing): every rank asks it
    store: bool | None  # the report's `store` (a live part due, or files the ranks store); None: the supervisor's call

    @property
    def checkpoint(self) -> bool:
        return self.carries in (Carries.FILES, Carries.LIVE, Carries.LOOP_STORED)

    @property
    def part(self) -> bool:
        """Does this rank hold a checkpoint part of it (the barrier's flag)?"""
        return self.carries in (Carries.FILES, Carries.LIVE)

    @property
    def sync(self) -> bool:
        """SYNC: stored whatever the cadence."""
        return self.mode is CheckpointUploadMode.SYNC

    @property
    def waits_commit(self) -> bool:
        """SYNC and NO_UPLOAD: report() returns once the checkpoint is committed."""
        return self.checkpoint and self.mode is not CheckpointUploadMode.ASYNC

    def decides(self, names: list[str] | None) -> bool:
        """Does this rank ask the supervisor to decide on the report (the barrier's `checkpoint` flag)?
        As planned, and for files the ranks would store themselves that are named as a dict part's:
        only the lowest rank stores those (supervisor/checkpoints/ledger.py `uploaders`), which the supervisor says."""
        return self.decide or (self.carries is Carries.FILES and names is not None and set(names) <= DICT_PART_NAMES)

    def goes_on(self, unwind_due: bool, previous: Agreed | None, pipelined: bool) -> bool:
        """Does the loop go on before the barrier passes (worker/report/barrier.py `goes_on`)?"""
        return goes_on(not self.checkpoint, unwind_due, previous, pipelined)


def plan_report(*, checkpoint: bool, in_memory: bool, mode: CheckpointUploadMode, user_upload: bool, named: bool,
                keeps_state: bool, live_due: bool, stores_every: bool = False) -> ReportPlan:
    """The plan of a report with (`checkpoint`) or without a checkpoint. `in_memory`: a
    `Checkpoint.from_dict`; `user_upload`: the loop passed an upload_fn; `named`: a checkpoint_dir_name;
    `keeps_state`: prepare_model(live_state=True); `live_due`: the cadence finds a live part due now;
    `stores_every`: no cadence, every checkpoint is stored (`CheckpointConfig.stores_every`).

    Without a cadence, the ranks need no one to decide on an ASYNC folder's files either: each stores
    its part, as the supervisor would have told it, and no rank waits for a round trip (~5 ms a
    report on 2 cores: benchmarks/RESULTS.md). A named one, and a SYNC one, still ask."""
    if checkpoint and user_upload:
        mode = CheckpointUploadMode.NO_UPLOAD
    if not checkpoint:
        carries = Carries.KEPT if keeps_state else Carries.NOTHING
    elif mode is CheckpointUploadMode.NO_UPLOAD:
        carries = Carries.LOOP_STORED
    elif in_memory and mode is CheckpointUploadMode.ASYNC:
        carries = Carries.LIVE
    else:
        carries = Carries.FILES
    live = carries in (Carries.LIVE, Carries.KEPT)
    ranks_store = stores_every and carries is Carries.FILES and mode is CheckpointUploadMode.ASYNC and not named
    store = (carries is Carries.LIVE and live_due) if live else (True if ranks_store else None)
    # The supervisor decides on a checkpoint's storage, except for a live dict part (unless named) and
    # files the ranks store themselves.
    decide = checkpoint and not ranks_store and (carries is not Carries.LIVE or named)
    return ReportPlan(carries, mode, decide, store)


@dataclass(frozen=True)
class AfterBarrier:
    """A report's course once its barrier passed."""

    together: bool  # every rank waited for this agreement: all act on it now
    drops_kept: bool  # a peer reports a checkpoint: the run resumes from that, not this kept state
    round_trip: bool  # the supervisor answers it; otherwise it is sent in a batch
    store: bool | None  # the report's `store` as sent in a batch
    stores_live: bool  # sent in a batch, every rank's live part due: the cadence starts again
    uploads_live: bool  # ... and this rank (rank 0) stores its part now
    uploads_files: bool  # sent in a batch, this rank's files: it stores them now (`plan_report`'s `stores_every`)
    keeps_unstored: bool  # sent in a batch, not stored: this rank stores its live part if the loop ends here
    unwind: bool  # leave the group after this report (or after the supervisor's reply asks it)


def after_barrier(plan: ReportPlan, agreed: Agreed, *, previous: Agreed | None, pipelined: bool,
                  leaving_here: bool, rank: int) -> AfterBarrier:
    """What `plan`'s report does once every rank's flags are `agreed`. `previous`: the last report's
    agreement; `leaving_here`: every rank's loop asked to leave at this report (get_preemption_info)."""
    # Unless all waited, peers may have gone on: they unwind with this rank after the next report.
    together = all_wait(previous, pipelined, leaving_here)
    drops_kept = plan.carries is Carries.KEPT and agreed.some_part
    holds_live = plan.carries is Carries.LIVE or (plan.carries is Carries.KEPT and not drops_kept)
    batched = not agreed.round_trip
    stores_live = batched and holds_live and agreed.store_live
    return AfterBarrier(
        together=together,
        drops_kept=drops_kept,
        round_trip=agreed.round_trip,
        store=agreed.store_live if plan.carries is Carries.LIVE else plan.store,
        stores_live=stores_live,
        uploads_live=stores_live and rank == 0,
        uploads_files=batched and plan.carries is Carries.FILES,
        keeps_unstored=batched and not stores_live and plan.carries is Carries.LIVE
        and (rank == 0 or not agreed.every_part),
        unwind=together and leaves(agreed, kept=plan.carries is Carries.KEPT),
    )


def leaves(agreed: Agreed, *, kept: bool) -> bool:
    """Does every rank leave the group at this report? When asked to (a peer leaves), or when newcomers
    join and the report carries a checkpoint (or, `kept`, the state kept live, alike on every rank):
    they start from it, and so do the survivors, which lose no step. A growth waits for such a report."""
    return agreed.unwind or (agreed.grow and (agreed.checkpoint or agreed.some_part or kept))
