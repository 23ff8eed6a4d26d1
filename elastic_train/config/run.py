"""`RunConfig` and the configs it holds besides `ElasticConfig`: where a run keeps its results
(`RunConfig`), how many failures it survives (`FailureConfig`), which checkpoints it stores and keeps
(`CheckpointConfig`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from elastic_train.config.elastic import ElasticConfig
from elastic_train.config.ray_only import ray_only
from elastic_train.config.renamed import renamed
from elastic_train.errors import ConfigError, qualified


@ray_only({
    "controller_failure_limit": "Ray restarts the supervisor up to ElasticConfig.supervisor_max_restarts times",
    "relax_collectives_on_preemption": "a preemption notice re-forms the group right after a report "
                                       "(see get_preemption_info)",
    "preemption_grace_s": "a worker under SIGTERM stays up ElasticConfig.preemption_sigterm_grace_s to hand "
                          "its state over",
}, deprecated={
    "fail_fast": "max_failures=0 (the default) fails the run on the first error",
})
@dataclass(frozen=True)
class FailureConfig:
    """How many failures of the user's code the run survives before it is declared failed.

    Lost workers (dead actors, lost nodes, silent heartbeats) do not count by default: an elastic run
    shrinks and goes on. Set `count_worker_loss=True` to make them count too.
    """

    max_failures: int = 0
    count_worker_loss: bool = False
    max_preemption_failures: int = -1
    """Preemptions the run survives (Ray Train's budget of its own, apart from `max_failures`); when
    spent, `fit()` raises `PreemptionError`. -1: no limit."""

    def __post_init__(self) -> None:
        for name in ("max_failures", "max_preemption_failures"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ConfigError(f"FailureConfig.{name}={value!r}: use an integer >= 0, or -1 for no limit.")


@renamed({"persist_every_n_reports": "store_every_n_reports", "persist_interval_s": "store_interval_s"})
@ray_only({}, deprecated={
    "checkpoint_frequency": "report a checkpoint when you want one (store only every n-th with "
                            "store_every_n_reports=n)",
    "checkpoint_at_end": "report a checkpoint at the end of the loop (the last one reported is always stored)",
})
@dataclass(frozen=True)
class CheckpointConfig:
    """Which stored checkpoints to keep: the `num_to_keep` best by a reported metric, or the newest.

    By default every reported checkpoint is stored, in order, none skipped (Ray Train's contract).
    Setting `store_every_n_reports` or `store_interval_s` opts into a cadence: the checkpoints
    between are kept in workers' memory only, and one waiting for an upload may be replaced by a newer.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    store_every_n_reports: int | None = None
    """Store every Nth reported checkpoint (the others live in workers' memory only)."""
    store_interval_s: float | None = None
    """Store a reported checkpoint when this long has passed since the last stored one."""

    def __post_init__(self) -> None:
        n = self.store_every_n_reports
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ConfigError(f"CheckpointConfig.store_every_n_reports={n!r}: use an integer >= 1, or None.")
        if self.store_interval_s is not None and not self.store_interval_s > 0:
            raise ConfigError(
                f"CheckpointConfig.store_interval_s={self.store_interval_s!r}: use a number of seconds > 0, or None."
            )
        if self.num_to_keep is not None and (not isinstance(self.num_to_keep, int) or self.num_to_keep < 1):
            raise ConfigError(
                f"CheckpointConfig.num_to_keep={self.num_to_keep!r}: keep at least 1 checkpoint, or None for all."
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise ConfigError(
                f"CheckpointConfig.checkpoint_score_order={self.checkpoint_score_order!r}: use 'max' or 'min'."
            )

    @property
    def stores_every(self) -> bool:
        """No cadence was asked for: every reported checkpoint is stored (Ray Train's contract)."""
        return self.store_every_n_reports is None and self.store_interval_s is None

    @property
    def replaceable(self) -> bool:
        """May a newer checkpoint replace a chosen one still waiting for its upload? Under a cadence,
        unless checkpoints are kept by score (skipping one could lose the best)."""
        return not self.stores_every and self.checkpoint_score_attribute is None

    def store_due(self, reports_since: int, since_stored_s: float) -> bool:
        """Is a reported checkpoint due to be stored, the `reports_since`-th since the last one stored,
        `since_stored_s` after it? Always, without a cadence. The supervisor asks for the checkpoints
        it decides on (supervisor/checkpoints/cadence.py); the ranks ask for the live dict parts they hold
        (worker/store/storing.py), which must be copied before the loop goes on, so they decide at the
        report's barrier and tell the supervisor."""
        if self.stores_every:
            return True
        n, interval = self.store_every_n_reports, self.store_interval_s
        return (n is not None and reports_since >= n) or (interval is not None and since_stored_s >= interval)


def _is_filesystem(value: Any) -> bool:
    """Is `value` a filesystem that storage can be on (fsspec's, or pyarrow's as in Ray)?"""
    import fsspec

    if isinstance(value, fsspec.AbstractFileSystem):
        return True
    import pyarrow.fs

    return isinstance(value, pyarrow.fs.FileSystem)


@ray_only({
    "worker_runtime_env": "give the runtime_env to ray.init(runtime_env=...)",
    "logging_config": "configure Python's logging in the loop",
}, deprecated={
    "sync_config": "checkpoints are written to storage_path directly",
    "progress_reporter": "follow reports with a UserCallback in RunConfig(callbacks=[...])",
    "log_to_file": "configure Python's logging in the loop",
    "stop": "stop from a UserCallback (raise in after_report) or with TorchTrainer.stop()",
    "verbose": "what fit() shows is ElasticConfig(verbosity=0, 1 or 2)",
})
@dataclass(frozen=True)
class RunConfig:
    """Where a run keeps its results and how it handles checkpoints and failures."""

    name: str | None = None
    storage_path: str | None = None
    checkpoint_config: CheckpointConfig | None = None
    failure_config: FailureConfig | None = None
    elastic_config: ElasticConfig | None = None
    storage_options: Mapping[str, Any] | None = None
    callbacks: list[Any] | None = None
    """`UserCallback`s, called in the driver process as the run goes (`callbacks.py`)."""
    storage_filesystem: Any = None
    """A filesystem (pyarrow's, as in Ray, or fsspec's) on which `storage_path` is a path (without one,
    the default storage root, as in Ray)."""

    def __post_init__(self) -> None:
        if self.storage_filesystem is not None:
            if not _is_filesystem(self.storage_filesystem):
                raise ConfigError("RunConfig(storage_filesystem=...) must be a pyarrow.fs.FileSystem or an fsspec "
                                  f"filesystem, got {type(self.storage_filesystem).__name__}.")
        wrong = [type(c).__name__ for c in self.callbacks or () if not getattr(c, "is_elastic_train_callback", False)]
        if wrong:
            raise ConfigError(
                f"RunConfig.callbacks: {', '.join(wrong)} is not an elastic_train.UserCallback; subclass it."
            )
        for attr, cls in (
            ("checkpoint_config", CheckpointConfig),
            ("failure_config", FailureConfig),
            ("elastic_config", ElasticConfig),
        ):
            value = getattr(self, attr)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(f"RunConfig.{attr} must be an elastic_train.{cls.__name__}, got {qualified(value)}: "
                                  f"use `elastic_train.{cls.__name__}` instead.")
        for attr, cls in (("checkpoint_config", CheckpointConfig), ("failure_config", FailureConfig)):
            if getattr(self, attr) is None:  # as Ray's RunConfig: its defaults, not None
                object.__setattr__(self, attr, cls())
        if self.name is not None and (not self.name or "/" in self.name):
            raise ConfigError(f"RunConfig.name={self.name!r}: use a non-empty name without '/'.")

    def resolved_storage_path(self) -> str:
        """The storage root: `storage_path`, else $ELASTIC_TRAIN_STORAGE, else ~/elastic_train_results."""
        return (
            self.storage_path
            or os.environ.get("ELASTIC_TRAIN_STORAGE")
            or os.path.join(os.path.expanduser("~"), "elastic_train_results")
        )
