"""Following a run from the driver: long-poll the supervisor's feed and hand each feed, in order, to
the user's callbacks, the run record and what `fit()` shows, until the run ends. A driver-side error
(a callback's, or an exception) stops the run cleanly before it propagates; a Ctrl-C aborts it."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import ray

from elastic_train.callbacks import CallbackRunner
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import TrainingFailedError
from elastic_train.events import Failure, GenerationOpened
from elastic_train.progress import Progress
from elastic_train.protocol import Feed
from elastic_train.result import stored_checkpoint
from elastic_train.run_folder.record import RunRecord
from elastic_train.run_folder.summary import RunSummary

logger = logging.getLogger(__name__)


class Dispatch:
    """Hands each feed of the supervisor to the callbacks, in order, and to the run record."""

    def __init__(self, callbacks: CallbackRunner, record: RunRecord, storage: RunStorage, progress: Progress):
        self._callbacks = callbacks
        self._record = record
        self._storage = storage
        self._progress = progress
        self._world_size: int | None = None

    def __call__(self, feed: Feed) -> None:
        for report in feed.reports:
            checkpoint = stored_checkpoint(self._storage, report.checkpoint) if report.checkpoint else None
            self._callbacks("after_report", report.metrics, checkpoint)
        for event in feed.events:
            opened, failure = GenerationOpened.of(event), Failure.of(event)
            if opened is not None:
                if self._world_size is not None and opened.world_size != self._world_size:
                    self._callbacks("after_resize", self._world_size, opened.world_size)
                self._world_size = opened.world_size
            elif failure is not None and failure.worker_failures:
                self._callbacks("after_exception", failure.worker_failures)
        self._record.add(feed.reports)
        self._progress.update(feed)


def follow(supervisor: Any, dispatch: Dispatch, record: RunRecord, interval_s: float) -> RunSummary:
    """Start the supervisor's run and follow it until it ends: long-poll the supervisor's feed (at most
    `interval_s` per call, so the record is written on time) and dispatch it; returns the summary.

    A callback's error (a `ControllerError`), or a `BaseException` raised in this thread (Tune's
    `SystemExit` from a callback) stops the run cleanly, waits for it to end, records it, and
    propagates; a Ctrl-C aborts it instead, its workers ended at once, as Ray Train's SIGINT handler
    aborts its controller, and raises `KeyboardInterrupt` once it ended (a second Ctrl-C leaves
    without waiting)."""
    run = supervisor.run.remote()
    report_cursor = event_cursor = 0
    incarnation = ""
    interrupted: list[str] = []  # why the run was aborted, once a Ctrl-C aborted it
    try:
        with _ctrl_c_aborts(supervisor, interrupted):
            while True:
                feed = ray.get(supervisor.feed.remote(report_cursor, event_cursor, interval_s, incarnation))
                report_cursor, event_cursor, incarnation = feed.report_cursor, feed.event_cursor, feed.incarnation
                dispatch(feed)
                if feed.over:
                    summary = ray.get(run)
                    break
                if ray.wait([run], timeout=0)[0]:
                    ray.get(run)  # raises if run() failed; one that returned has fed everything: the next feed is over
    except ray.exceptions.RayError:
        raise
    except BaseException as exc:
        if interrupted and isinstance(exc, KeyboardInterrupt):
            raise  # a second Ctrl-C: the run is aborting already
        reason = f"{type(exc).__name__} in the driver: {exc}"
        logger.warning("stopping the run: %s", reason)
        supervisor.stop_run.remote(reason)
        summary = ray.get(run)
        failed = isinstance(exc, TrainingFailedError)
        record.finish("errored" if failed else summary.state.value, summary, exc if failed else None)
        raise
    if interrupted:
        record.finish(summary.state.value, summary)
        raise KeyboardInterrupt(interrupted[0])
    return summary


@contextlib.contextmanager
def _ctrl_c_aborts(supervisor: Any, interrupted: list[str]) -> Iterator[None]:
    """While it lasts, the first SIGINT aborts the run (`interrupted` then holds why) and the next
    raises `KeyboardInterrupt` as Python's own handler does. A handler, as Ray Train registers one: the
    `KeyboardInterrupt` of Python's handler must travel out of Ray's C++ wait in `ray.get`, and a run
    was seen going on after it. Only the main thread may set one, and only it gets the signal (Tune
    runs `fit()` in another thread, and handles a Ctrl-C itself)."""

    def abort(signum: int, frame: Any) -> None:
        reason = "KeyboardInterrupt in the driver: Ctrl-C"
        logger.warning("aborting the run: %s", reason)
        interrupted.append(reason)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        supervisor.abort_run.remote(reason)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, abort)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
