"""`Result`: what `TorchTrainer.fit()` returns, or `Result.from_path` reads back (Ray Train's names)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from elastic_train.checkpoint import Checkpoint
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ConfigError, TrainingFailedError
from elastic_train.events import GenerationOpened
from elastic_train.run_folder.event_log import read_events
from elastic_train.run_folder.record import HISTORY_KEYS, METRICS, RUN, read_json


def stored_checkpoint(storage: RunStorage, committed: CommittedCheckpoint) -> Checkpoint:
    """The `Checkpoint` of a committed checkpoint: its files are read through its manifest."""
    return Checkpoint(storage.folder(committed.attempt), storage.fs, committed.manifest)


def _lookup(metrics: Mapping[str, Any], metric: str) -> Any:
    """`metrics[metric]`, where "a/b" also reaches `metrics["a"]["b"]` (as Ray's lookup); None if absent."""
    if metric in metrics:
        return metrics[metric]
    value: Any = metrics
    for part in metric.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


@dataclass
class Result:
    metrics: dict[str, Any]
    """The last metrics rank 0 reported, with or without a checkpoint."""
    checkpoint: Checkpoint | None
    """The newest committed checkpoint in storage."""
    path: str
    """The run's folder in storage."""
    error: TrainingFailedError | None = None
    """Why the run failed, with the original traceback; None if it finished. `fit()` raises this error
    rather than return it (as Ray Train): it is set by `Result.from_path` for a run that failed, and
    in the `Result` that `UserCallback.on_run_end` receives."""
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's metrics of every report, in order."""
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    """Every committed checkpoint that retention (`CheckpointConfig.num_to_keep`) kept, with the
    metrics reported beside it, oldest first."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The supervisor's timeline: generations, lost workers, fenced writes, state changes; as the run's
    `events.jsonl` holds them (JSON: keys are strings, exceptions their repr)."""
    return_value: Any = None
    """What rank 0's `train_loop_per_worker` returned (Ray Train V2), or None. Not kept in the run's
    folder (nothing there is unpickled): None in `Result.from_path`."""
    filesystem: Any = field(default=None, repr=False)
    """The filesystem of the run's storage, fsspec's (Ray's is pyarrow's); None in a Result built by hand."""

    @property
    def metrics_dataframe(self):
        """Every report of rank 0 as a pandas DataFrame, one row per report."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)

    @property
    def world_sizes(self) -> list[int]:
        """The world size of every generation, in order (a generation that a restarted supervisor
        adopted is logged again; it counts once)."""
        sizes: dict[int, int] = {}
        for opened in filter(None, map(GenerationOpened.of, self.events)):
            sizes.setdefault(opened.generation, opened.world_size)
        return list(sizes.values())

    def get_best_checkpoint(self, metric: str, mode: str) -> Checkpoint | None:
        """The kept checkpoint whose reported `metric` is the largest (`mode="max"`) or smallest
        (`"min"`); checkpoints reported without that metric are left out (Ray Train's rules: a
        RuntimeError when there is no checkpoint, or none has the metric)."""
        if not self.best_checkpoints:
            raise RuntimeError(f"No checkpoint exists in the run folder {self.path}!")
        if mode not in ("max", "min"):
            raise ValueError(f'Unsupported mode: {mode}. Please choose from ["min", "max"]!')
        valid = [(c, m) for c, m in self.best_checkpoints if _lookup(m, metric) is not None]
        if not valid:
            raise RuntimeError(f"Invalid metric name {metric}! You may choose from the following metrics: "
                               f"{sorted(self.metrics)}.")
        pick = max if mode == "max" else min
        return pick(valid, key=lambda entry: _lookup(entry[1], metric))[0]

    @classmethod
    def from_path(cls, path: str | os.PathLike, storage_filesystem: Any = None, *,
                  storage_options: Mapping[str, Any] | None = None) -> "Result":
        """The result of the run whose folder is `path` (a `Result.path`: any fsspec URL, with the
        `storage_options` the run used; or, as in Ray, a path on `storage_filesystem`, pyarrow's or
        fsspec's), read from its record (`run_folder/record.py`), its event log
        (`events.jsonl`) and the manifests of its committed checkpoints. Works for a run under way,
        and after its driver died: the metrics are then those written up to
        `ElasticConfig.run_record_interval_s` before, the events up to `event_log_interval_s`.
        `error` is set when the run failed: a `TrainingFailedError` with the message (and the
        traceback) that `fit()` raised. Nothing in the folder is unpickled."""
        if isinstance(storage_filesystem, Mapping):  # this argument was storage_options before Ray's took its place
            warnings.warn("Result.from_path(path, storage_options) is deprecated: its second argument is now Ray's "
                          "storage_filesystem; pass storage_options=... by name", DeprecationWarning, stacklevel=2)
            storage_options, storage_filesystem = storage_filesystem, None
        storage = RunStorage.at(path, storage_options, filesystem=storage_filesystem)
        run = read_json(storage, RUN, None)
        committed = storage.committed()
        if run is None and not committed:
            raise ConfigError(f"Result.from_path({path!r}): no run record ({RUN}) and no committed checkpoint "
                              "there. Pass a run's folder (its Result.path), with the storage_options it used.")
        history = read_json(storage, METRICS, [])
        failure = (run or {}).get("error")
        checkpoints = [(stored_checkpoint(storage, c), c.metrics) for c in committed]
        return cls(
            metrics={k: v for k, v in history[-1].items() if k not in HISTORY_KEYS} if history else {},
            checkpoint=checkpoints[-1][0] if checkpoints else None,
            path=storage.url(),
            error=TrainingFailedError(failure["message"]) if failure else None,
            metrics_history=history,
            best_checkpoints=checkpoints,
            events=read_events(storage),
            filesystem=storage.fs,
        )
