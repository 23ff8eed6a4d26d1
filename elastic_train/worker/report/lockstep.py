"""Reports in lockstep: the session's side of report()'s barrier (worker/report/barrier.py).

Every rank waits at a report until every rank made it, except that a plain report may go on with
its barrier in flight (`go_on`), awaited at the next report (`confirm`) or as the loop ends
(`finish`). A barrier that fails ends the generation; the report whose barrier failed still counts
(`unagreed`) if the step before it made a collective with every peer (`stepped`): each rank's share
of the step is then in the state it holds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from elastic_train.errors import GenerationEnded, PeerLost
from elastic_train.protocol import HeldCheckpoint, Report
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.loop.host import WorkerServices
from elastic_train.worker.report.barrier import Agreed, Agreement, agree, collectives_done, issue


@dataclass
class MadeReport:
    """A report this rank made, with the part it holds of it."""

    report: Report
    held: HeldCheckpoint | None
    live: LivePart | None
    stepped: bool  # the step before it made a collective with every peer (`Lockstep.stepped`)


class _Pending:
    """A plain report that went on before its barrier passed. Its report goes to the supervisor once
    the barrier passed, from the thread that completes it: a peer whose round trip waits for every
    rank's report is not held a step. Sent once, before any later report of this rank."""

    def __init__(self, agreement: Agreement, made: MadeReport, host: WorkerServices):
        self.agreement, self.made = agreement, made
        self._host = host
        self._sent = False
        self._lock = threading.Lock()

    def send(self, agreed: Agreed) -> None:
        with self._lock:
            if self._sent:
                return
            self._sent = True
            if agreed.some_part:  # a peer reports a checkpoint: the run resumes from that, not a kept state
                self.made.report.names = None
                self.made.report.part_ranks = list(agreed.part_ranks)
            self._host.send_report(self.made.report, agreed.round_trip)


class Lockstep:
    """One generation's report barriers, as this rank waits at them."""

    def __init__(self, host: WorkerServices, world_size: int):
        self._host = host
        self._world_size = world_size
        self.unagreed: Report | None = None  # a report whose barrier failed, whose live part still counts
        self._collectives_seen = collectives_done()  # the group's collectives up to the last barrier passed
        self._agreed: Agreed | None = None  # the last report's agreement, which every rank knows by now
        self._pending: _Pending | None = None  # a plain report that went on, its agreement in flight
        self._step_committed = False  # NCCL: the kept state's step since the last barrier was agreed (`commit_step`)
        self._unsent: _Pending | None = None  # a report that went on, its barrier failed: the survivors' (`reformed`)

    def stepped(self) -> bool:
        """Did the step since the last report make a collective with every peer (see `_keep_unagreed`)?"""
        if dist.is_initialized() and dist.get_backend() == "nccl":  # issued is not done: only a committed step counts
            stepped, self._step_committed = self._step_committed, False
        else:
            done, seen = collectives_done(), self._collectives_seen
            stepped = done is not None and seen is not None and done > seen
        return stepped or self._world_size == 1

    def commit_step(self) -> None:
        """Before the kept state's optimizer steps, under NCCL: there the step's gradient all-reduce runs
        on the GPU after the loop has moved on, and the optimizer's kernels would apply whatever a failed
        one left in the gradients. As torchft does, every rank agrees first: a one-element all-reduce
        after the gradients', on the same communicator, read here. It adds up to the world size only if
        every rank's gradients came through; otherwise the step is not taken and the loop unwinds, its
        state still the last report's."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        ones = torch.ones(1, dtype=torch.int32, device=torch.device("cuda", torch.cuda.current_device()))
        try:
            dist.all_reduce(ones)
            agreed = int(ones.item()) == dist.get_world_size()
        except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
            raise PeerLost(f"the step's commit before optimizer.step() failed: {exc}") from exc
        if not agreed or self._host.generation_ended():
            raise PeerLost("a peer was lost during the step's gradient all-reduce: the step is not taken")
        self._step_committed = True

    def confirm(self, made: MadeReport) -> Agreed | None:
        """The previous report's agreement, awaited if that report went on without it; its kept state
        is then held. If it failed, `made` is the report whose barrier failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                self._agreed = pending.agreement.result()
            except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
                self._unsent, self._agreed = pending, Agreed(False, False, False, False)  # if it goes on in place
                self._barrier_failed(exc, pending.made.report.index, made)
            pending.send(self._agreed)
            previous = pending.made
            if _held_once_agreed(previous) and previous.report.names is not None:
                self._host.hold(previous.held, previous.live, False, None)
        return self._agreed

    def agree(self, made: MadeReport, checkpoint: bool, part: bool, store_live: bool, sends: int = 0) -> Agreed:
        """The report's barrier, waited for; unwinds the loop when it fails. `sends`: the bytes of this
        rank's part that go to its buddy (worker/report/part_exchange.py)."""
        self._check_ended(made)
        try:
            index = made.report.index
            agreed = agree(checkpoint, self._host.unwind_due(index), part, store_live, self._host.grow_due(index),
                           sends)
        except Exception as exc:  # noqa: BLE001 - a failed collective: the generation is over either way
            self._barrier_failed(exc, made.report.index, made)
        self._agreed, self._collectives_seen = agreed, collectives_done()
        return agreed

    def settle_pending(self) -> None:
        """Before the group re-forms under the loop: settle a report that went on before its barrier
        passed, on the group being left, as the next report would (`confirm`): its kept state is held
        and the supervisor hears of it before this worker parks, so that a loop that does not go on
        in place is re-entered from it. If the barrier failed, the lost peer never made that report;
        the survivors did (they stand at one position past it): it counts as theirs, with nothing
        agreed but its metrics (`_keep_unagreed`), and is sent once the loop goes on in place
        (`reformed`)."""
        pending = self._pending
        if pending is None:
            return
        try:
            self.confirm(pending.made)
        except (PeerLost, GenerationEnded):
            pass  # the lost peer's share of the barrier never came

    def reformed(self, world_size: int, generation: int) -> None:
        """The loop goes on in place as generation `generation`, in a group of `world_size`: the barriers
        from here on are its (a report whose barrier failed is agreed again there)."""
        self._world_size, self._collectives_seen = world_size, collectives_done()
        self.unagreed = None
        unsent, self._unsent = self._unsent, None
        if unsent is not None and self._agreed is not None:
            unsent.made.report.generation = generation
            unsent.send(self._agreed)

    def go_on(self, made: MadeReport) -> None:
        """A plain report leaves before its barrier passed: the next report (or the loop's end) awaits it."""
        self._check_ended(made)
        agreement = issue(False, False, False, False)
        self._collectives_seen = collectives_done()
        self._pending = _Pending(agreement, made, self._host)
        agreement.on_passed(self._pending.send)

    def finish(self) -> None:
        """The loop returned: its last report counts once every rank made it (raises if one did not)."""
        pending = self._pending
        if pending is not None:
            self.confirm(pending.made)

    def _check_ended(self, made: MadeReport) -> None:
        if self._host.generation_ended():
            self._keep_unagreed(made)
            raise GenerationEnded()

    def _barrier_failed(self, exc: Exception, index: int, made: MadeReport) -> NoReturn:
        self._keep_unagreed(made)
        if self._host.generation_ended():
            raise GenerationEnded() from exc
        raise PeerLost(f"report {index}'s barrier failed: {exc}") from exc

    def _keep_unagreed(self, made: MadeReport) -> None:
        """The report's barrier did not pass, so some rank may not have made this report. Its live dict
        part still counts if the step before it made a collective (DDP's gradient all-reduce) with
        every peer: each rank's share of the step is then in the state held. That state is the
        freshest there is: the previous report's live part holds the same tensors, moved on since. The
        supervisor hears of it when this worker parks, and may resume the next generation from it."""
        if _held_once_agreed(made) and made.stepped:
            self._host.hold(made.held, made.live, False, None)
        if made.held is not None and made.live is not None and made.stepped:
            self.unagreed = made.report


def _held_once_agreed(made: MadeReport) -> bool:
    """Is `made`'s live part held once its barrier passed? Not a rank's share of a sharded model: that
    is held as it is reported (worker/loop/session.py)."""
    return made.held is not None and made.live is not None and not made.live.private
