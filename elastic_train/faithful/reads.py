"""What the running loop read of its place, at run time: the dynamic half of faithfulness.

Going on in place is faithful to Ray Train (which re-runs the loop at every new world) only if nothing
the loop computed from its old place is used in the new one. So every read of the loop's place is
recorded here with its site (sites.py): `get_context()`'s rank, world size, local rank and node rank,
`torch.distributed`'s rank and world size (and a `DistributedSampler` built without them), the
`RANK`/`WORLD_SIZE`/... variables, and `len()` of a prepared loader (the epoch's steps, "epoch_steps").
A survivor parks with the reads that still matter (`relevant`): those whose site holds its value, those
used where read since the step began (they may have shaped the collective that failed), and the
collectives its loop makes after its steps (combines.py). The supervisor compares them with the next
generation's places (supervisor/policy.py `unfaithful`).
Reads from the library's own code, from other threads, and from no loop are not the loop's.
"""

from __future__ import annotations

import collections.abc
import os
import sys
import sysconfig
import threading
from types import CodeType, FrameType

from elastic_train.faithful.combines import combined_after_steps
from elastic_train.faithful.sites import FRAME, LOGGED, STEP, Site, site
from elastic_train.protocol import PlaceRead

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USERS_OF_OURS = (os.path.join(_OURS, "demo.py"),)  # loops the library ships as a user writes them
_LIBRARIES = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "purelib", "platlib")})
ENV = {"RANK": "rank", "WORLD_SIZE": "world_size", "LOCAL_RANK": "local_rank", "LOCAL_WORLD_SIZE": "local_world_size",
       "NODE_RANK": "node_rank", "GROUP_RANK": "node_rank"}


class PlaceReads:
    """One loop's reads of its place, from its entry (a loop entered afresh starts anew)."""

    def __init__(self) -> None:
        # By (site, what): held values outlive their step; with the code of the function whose frame
        # alone holds one (sites.py `spent_with`), else None.
        self._held: dict[tuple[str, str], tuple[PlaceRead, CodeType | None]] = {}
        self._step: dict[tuple[str, str], PlaceRead] = {}  # used where read (or spent with it), since the step began
        self._stepped = False  # a step ended and no batch was drawn since: the next draw begins a step

    def read(self, what: str, value: int, where: Site, code: CodeType) -> None:
        if where.use == LOGGED:
            return
        record = PlaceRead(where.where, what, value, where.held, where.text)
        if where.held and where.spent_with != STEP:
            self._held[(record.site, what)] = (record, code if where.spent_with == FRAME else None)
        else:
            self._step[(record.site, what)] = record

    def step_done(self) -> None:
        """A step's gradients were reduced, or a report made: values used where read are spent."""
        self._step.clear()
        self._stepped = True

    def drawn(self) -> None:
        """A prepared loader drew a batch: the first after a step begins the next step, and what the
        loop used after the last one (its optimizer step, its logs) is spent. Later draws of one step
        (gradient accumulation) keep what its earlier micro-batches used."""
        if self._stepped:
            self._step.clear()
            self._stepped = False

    def relevant(self, at: str) -> tuple[PlaceRead, ...]:
        """The reads a recovery `at` (protocol.Position.at) must not change: every held one whose holder
        lives (called on the loop's thread, inside the loop: a function off its stack has returned), and
        those used where read in the step under way (none at "leave": the report they led to was agreed)."""
        running, frame = set(), sys._getframe(1)
        while frame is not None:
            running.add(frame.f_code)
            frame = frame.f_back
        held = tuple(read for read, code in self._held.values() if code is None or code in running)
        combined = () if at == "leave" else combined_after_steps(sys._getframe(1), loops_file)
        return held + (() if at == "leave" else tuple(self._step.values())) + combined


class _Following:
    """The loop this process runs now, and the sites of the reads seen so far (by code and instruction)."""

    def __init__(self) -> None:
        self.tracker: PlaceReads | None = None
        self.thread: int | None = None
        self.sites: dict[tuple[CodeType, int], Site] = {}


_following = _Following()


def follow(tracker: PlaceReads | None) -> None:
    """`tracker` records the reads of the loop running on this thread from now (None: no loop runs)."""
    _following.tracker = tracker
    _following.thread = threading.get_ident() if tracker is not None else None


def drawn() -> None:
    """The loop drew a batch from a prepared loader (ingest/cursor.py): `PlaceReads.drawn`."""
    if _following.tracker is not None and _following.thread == threading.get_ident():
        _following.tracker.drawn()


def record(what: str, value: int, frame: FrameType | None, through: frozenset[CodeType] = frozenset()) -> None:
    """The loop read `what` = `value`; `frame` is the reader's (`sys._getframe(1)` of the reading
    function). With `through` (torch's `get_rank`, `os.getenv`, ...), only a read the loop made
    directly through those counts; without, library frames between the loop and the read are passed."""
    tracker = _following.tracker
    if tracker is None or _following.thread != threading.get_ident():
        return
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(_OURS) and file not in _USERS_OF_OURS:
            return  # the library's own read (prepare_data_loader's, DDP's in prepare_model)
        if through and frame.f_code in through:
            frame = frame.f_back
            continue
        if loops_file(file):
            tracker.read(what, value, _site_of(frame), frame.f_code)
            return
        if through:
            return  # torch's own read, inside a collective or a module of its own
        frame = frame.f_back


def loops_file(file: str) -> bool:
    """Is `file` the loop's code: neither the library's, nor an installed package's or Python's own?"""
    if file.startswith(_OURS):
        return file in _USERS_OF_OURS
    return not file.startswith(_LIBRARIES) and not file.startswith("<frozen")


def _site_of(frame: FrameType) -> Site:
    key = (frame.f_code, frame.f_lasti)
    found = _following.sites.get(key)
    if found is None:
        positions = list(frame.f_code.co_positions())  # one per code unit: f_lasti is in bytes
        at = positions[frame.f_lasti // 2] if frame.f_lasti // 2 < len(positions) else (frame.f_lineno, None, None, None)
        found = _following.sites[key] = site(frame.f_code.co_filename, at[0] or frame.f_lineno, at)
    return found


class _TrackedEnviron(type(os.environ)):  # type: ignore[misc]
    """`os.environ`, whose reads of the place variables are the loop's reads of its place."""

    def __getitem__(self, key: str) -> str:
        value = super().__getitem__(key)
        if key in ENV and _following.tracker is not None and value.lstrip("-").isdigit():
            record(ENV[key], int(value), sys._getframe(1), _ENV_THROUGH)
        return value


def _codes(*functions: object) -> frozenset[CodeType]:
    return frozenset(f.__code__ for f in functions)  # type: ignore[attr-defined]


# `os.environ.get(...)` and `in os.environ` reach __getitem__ through Mapping's methods
_ENV_THROUGH = _codes(os.getenv, collections.abc.Mapping.get, collections.abc.Mapping.__contains__)


def track_environment() -> None:
    """Record the loop's reads of `RANK`, `WORLD_SIZE`, ... (idempotent; for the worker process)."""
    if not isinstance(os.environ, _TrackedEnviron):
        os.environ.__class__ = _TrackedEnviron
