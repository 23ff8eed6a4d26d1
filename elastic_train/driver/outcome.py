"""What `fit()` makes of the summary a run ended with: its `Result` and, for a run that failed, the
error `fit()` raises (as Ray Train raises it). Pure functions of the summary and the run's storage."""

from __future__ import annotations

import json
import logging
from typing import Any

from ray import cloudpickle

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ControllerError, PreemptionError, TrainingFailedError, WorkerGroupError
from elastic_train.result import Result, stored_checkpoint
from elastic_train.run_folder.record import to_json
from elastic_train.run_folder.summary import RunSummary
from elastic_train.supervisor.state import RunState

logger = logging.getLogger(__name__)


def failure(summary: RunSummary) -> TrainingFailedError | None:
    """The error `fit()` raises for a run that ended ERRORED; None for one that finished."""
    if summary.state is not RunState.ERRORED:
        return None
    if summary.preemption is not None:
        error: TrainingFailedError = PreemptionError(summary.preemption)
        if summary.error:
            error.add_note(summary.error)
        return error
    if summary.worker_failures:
        return WorkerGroupError(summary.error or "", summary.worker_failures)
    return ControllerError(RuntimeError(summary.error))


def returned(pickled: bytes | None) -> Any:
    """What rank 0's loop returned; None (with a warning) when it cannot be loaded here, e.g. its class
    is not importable in the driver: the run itself finished."""
    if pickled is None:
        return None
    try:
        return cloudpickle.loads(pickled)
    except Exception as exc:  # noqa: BLE001 - any error of the value's own unpickling
        logger.warning("Result.return_value is None: what the loop returned could not be loaded here (%r)", exc)
        return None


def run_result(summary: RunSummary, storage: RunStorage) -> Result:
    """The run's `Result`: its metrics, its committed checkpoints (the newest as `checkpoint`), its
    events and what the loop returned; `error` is `failure(summary)`."""
    checkpoints = [(stored_checkpoint(storage, c), c.metrics) for c in summary.checkpoints]
    return Result(
        metrics=summary.metrics,
        checkpoint=checkpoints[-1][0] if checkpoints else None,
        path=storage.url(),
        error=failure(summary),
        metrics_history=summary.metrics_history,
        best_checkpoints=checkpoints,
        events=json.loads(to_json(summary.events)),  # as the event log (events.jsonl) holds them
        return_value=returned(summary.returned),
        filesystem=storage.fs,
    )
