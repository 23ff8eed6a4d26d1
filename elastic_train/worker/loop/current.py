"""The session of the loop running in this process: what `report()`, `get_context()` and the other
loop-side calls find, set as each generation's loop starts and cleared as it leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from elastic_train.faithful import reads
from elastic_train.worker.group.world import follow

if TYPE_CHECKING:
    from elastic_train.worker.loop.session import TrainSession


_current: TrainSession | None = None
_session_hooks: list[Callable[[TrainSession], None]] = []


def on_session_start(hook: Callable[[TrainSession], None]) -> None:
    """Call `hook(session)` whenever a generation's session starts in this process, before the loop
    runs: a framework that keeps the world in process-wide state (Accelerate's `PartialState`)
    resets it there, since a survivor's process outlives its generation."""
    if hook not in _session_hooks:
        _session_hooks.append(hook)


def set_session(session: TrainSession | None) -> None:
    """`session`'s loop runs on this thread from now (None: no loop runs); the default group's
    failures go on in place through it."""
    global _current
    _current = session
    follow(session)
    reads.follow(session.reads if session is not None else None)
    if session is not None:
        for hook in list(_session_hooks):
            hook(session)


def current_session() -> TrainSession | None:
    """The running generation's session, or None outside a worker's loop."""
    return _current


def get_session(caller: str) -> TrainSession:
    if _current is None:
        raise RuntimeError(
            f"elastic_train.{caller}() works only inside train_loop_per_worker, run by TorchTrainer.fit()."
        )
    return _current
