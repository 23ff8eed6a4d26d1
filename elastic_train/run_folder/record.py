"""The run record: what `Result.from_path` and `TorchTrainer.restore` read from a run's folder.

The driver writes it as the run goes, so that it survives the driver: the run's config and state
(`run.json`) and rank 0's metrics of every report (`metrics.json`), JSON, rewritten at most every
`ElasticConfig.run_record_interval_s` and at the end; and, once at the start, `trainer.pkl`: the loop and the trainer's arguments, pickled with
cloudpickle (as Ray does), so that `TorchTrainer.restore(path)` can go on without the loop. The
checkpoint list is not recorded here: the committed checkpoints' manifests are the record of them;
nor are the events: the supervisor writes them (`events.jsonl`, run_folder/event_log.py).

Reading: the JSON files are parsed as JSON. `trainer.pkl` is the only file ever unpickled, and only
by `load_trainer`, which `TorchTrainer.restore` calls when it is not given the loop. Storage
credentials (`RunConfig.storage_options`) are never written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from ray import cloudpickle

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ConfigError, StorageError
from elastic_train.protocol import ReportRecord

if TYPE_CHECKING:
    from elastic_train.run_folder.summary import RunSummary

logger = logging.getLogger(__name__)

RUN = "run.json"
METRICS = "metrics.json"
TRAINER = "trainer.pkl"
FORMAT_VERSION = 1
HISTORY_KEYS = ("_index", "_generation", "_world_size", "_time")  # what a metrics_history entry adds to the metrics


def _jsonable(value: Any) -> Any:
    """JSON for what json cannot write itself: scalars of numpy and torch as numbers, dataclasses as
    dicts, anything else as its repr."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return repr(value)


def to_json(value: Any) -> str:
    return json.dumps(value, default=_jsonable)


class RunRecord:
    """Writes a run's record while the driver follows the run. A write that fails is logged and
    left for the next one: the record must not fail a run that storage lets train."""

    def __init__(self, storage: RunStorage, run_id: str, config: dict[str, Any], interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._storage = storage
        self._interval_s = interval_s
        self._clock = clock
        self._run: dict[str, Any] = {"format": FORMAT_VERSION, "name": storage.name, "run_id": run_id, "state": "running",
                                     "started": time.time(), "ended": None, "stopped": None, "error": None,
                                     "config": config}
        self._metrics: list[dict[str, Any]] = []
        self._written = -1  # how many metrics entries storage has (-1: none yet)
        self._last_write = clock()

    def start(self, trainer: dict[str, Any]) -> None:
        """Write the run's config, `trainer.pkl` (the trainer's arguments, loop included), and an
        empty list of metrics: an earlier run's with this name are not this one's."""
        try:
            data = cloudpickle.dumps({"format": FORMAT_VERSION, **trainer})
        except Exception as exc:  # noqa: BLE001 - anything a pickler raises: restore then needs the loop
            logger.warning("%s is not written: the trainer could not be pickled (%s); TorchTrainer.restore(%r) "
                           "will need the loop passed again", TRAINER, exc, self._storage.url())
        else:
            self._write(TRAINER, lambda: self._storage.write_bytes(TRAINER, data))
        self._put(RUN, self._run)
        self._write_metrics()

    def add(self, reports: list[ReportRecord]) -> None:
        """New reports (rank 0's metrics of each are kept, as `Result.metrics_history` holds them);
        written when the interval has passed."""
        self._metrics.extend({**(r.metrics[0] if r.metrics else {}), "_index": r.index, "_generation": r.generation,
                              "_world_size": r.world_size, "_time": r.time} for r in reports)
        if self._clock() - self._last_write >= self._interval_s:
            self._write_metrics()

    def finish(self, state: str, summary: RunSummary | None = None, error: BaseException | None = None) -> None:
        """The run ended: write everything, from the supervisor's `summary` (its whole history) when
        there is one (None: the supervisor is gone; what was fed is kept)."""
        if summary is not None:
            self._metrics = list(summary.metrics_history)
            self._written = -1
        self._run.update(state=state, ended=time.time(), stopped=summary.stopped if summary else None,
                         error=None if error is None else {"type": type(error).__name__, "message": str(error)})
        self._write_metrics()
        self._put(RUN, self._run)

    def _write_metrics(self) -> None:
        self._last_write = self._clock()
        if self._written != len(self._metrics) and self._put(METRICS, self._metrics):
            self._written = len(self._metrics)

    def _put(self, name: str, value: Any) -> bool:
        """Write a JSON file of the record whole (never seen half written)."""
        return self._write(name, lambda: self._storage.write_text(name, to_json(value)))

    def _write(self, name: str, write: Callable[[], None]) -> bool:
        try:
            write()
            return True
        except StorageError as exc:
            logger.warning("the run record's %s was not written: %s", name, exc)
            return False


def read_json(storage: RunStorage, name: str, default: Any) -> Any:
    """A JSON file of the record; `default` when it is missing."""
    raw = storage.read(name)
    if raw is None:
        return default
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"{storage.url(name)} is not valid JSON ({exc}): the run record is damaged.") from exc


def load_trainer(storage: RunStorage) -> dict[str, Any]:
    """The trainer's arguments from `trainer.pkl`. This unpickles, that is runs, code from storage:
    only `TorchTrainer.restore` without a loop calls it."""
    raw = storage.read(TRAINER)
    if raw is None:
        raise ConfigError(
            f"TorchTrainer.restore({storage.url()!r}): there is no {TRAINER}, so the training loop cannot be "
            "restored from storage (a run of an older release, or its loop could not be pickled). Pass the loop: "
            "TorchTrainer.restore(path, train_loop_per_worker)."
        )
    try:
        trainer = cloudpickle.loads(raw)
    except Exception as exc:  # noqa: BLE001 - a missing module, a version mismatch, a damaged file
        raise ConfigError(
            f"TorchTrainer.restore({storage.url()!r}): {TRAINER} could not be loaded ({type(exc).__name__}: {exc}). "
            "The loop's module must be importable here, with the versions that pickled it; or pass the loop: "
            "TorchTrainer.restore(path, train_loop_per_worker)."
        ) from exc
    if not isinstance(trainer, dict) or trainer.get("format") != FORMAT_VERSION:
        raise ConfigError(f"TorchTrainer.restore({storage.url()!r}): {TRAINER} is not one this release wrote; "
                          "pass the loop: TorchTrainer.restore(path, train_loop_per_worker).")
    trainer.pop("format")
    return trainer


__all__ = ["RunRecord", "read_json", "load_trainer", "to_json", "RUN", "METRICS", "TRAINER", "HISTORY_KEYS"]
