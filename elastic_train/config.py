"""User-facing configuration, with Ray Train's names and an `ElasticConfig` for our own knobs.

Every config validates itself on construction, so bad input fails in the driver, before any actor
starts, with a message that names the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from elastic_train.errors import ConfigError, RayDeprecatedError

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


_OPTIONAL_S = ("progress_timeout_s",)  # None turns these off


def _ray_only(fields: dict[str, str], deprecated: dict[str, str] | None = None) -> Callable[[type], type]:
    """Fields of Ray Train's config that elastic_train does not have: passing one fails with what to
    use instead, not with a bare TypeError. Those Ray deprecated (`deprecated`) fail as they do in
    Ray, with a `DeprecationWarning` (`RayDeprecatedError`)."""
    deprecated = deprecated or {}

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name in sorted(kwargs.keys() & deprecated.keys()):
                raise RayDeprecatedError(f"{cls.__name__}({name}=...) is deprecated (as in Ray Train): "
                                         f"{deprecated[name]}.")
            for name in sorted(kwargs.keys() & fields.keys()):
                raise ConfigError(f"{cls.__name__}({name}=...) is Ray Train's; elastic_train does not support it: "
                                  f"{fields[name]}.")
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.RAY_ONLY_FIELDS = {**fields, **deprecated}
        return cls
    return wrap


def _check_positive(owner: str, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive number of seconds, got {value!r}.")


@_ray_only({
    "use_tpu": "it trains PyTorch on GPUs (use_gpu=True) or CPUs",
    "topology": "it trains PyTorch on GPUs (use_gpu=True) or CPUs",
    "accelerator_type": "ask for it as a resource, resources_per_worker={'accelerator_type:A100': 0.001}",
    "label_selector": "place workers with custom node resources in resources_per_worker",
}, deprecated={
    "trainer_resources": "the supervisor takes no resources, and the driver runs where fit() is called",
})
@dataclass(frozen=True)
class ScalingConfig:
    """How many workers to run and what each one needs.

    `num_workers` is either a fixed count or a `(min, max)` range: the run starts with as many as the
    cluster can place (at least `min`), shrinks when workers are lost and grows back to `max` when
    capacity appears. 0 is Ray Train's local mode, which runs the loop in the driver's process; here
    it runs in one worker (every worker is a Ray actor, whose process outlives its generations).
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: Mapping[str, float] | None = None
    placement_strategy: str = "PACK"
    elastic_resize_monitor_interval_s: float = 60.0
    """Ray Train's; taken so its code runs, with nothing to tune here: Ray re-checks capacity this
    often and restarts the group to grow, while elastic_train keeps a worker pending and grows at
    the next report after it starts."""

    def __post_init__(self) -> None:
        if not isinstance(self.elastic_resize_monitor_interval_s, (int, float)) or self.elastic_resize_monitor_interval_s < 0:
            raise ConfigError("ScalingConfig.elastic_resize_monitor_interval_s must be a number of seconds >= 0, "
                              f"got {self.elastic_resize_monitor_interval_s!r}.")
        n = self.num_workers
        if isinstance(n, list):
            object.__setattr__(self, "num_workers", n := tuple(n))
        if isinstance(n, tuple):
            if len(n) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in n):
                raise ConfigError(
                    f"ScalingConfig.num_workers={n!r}: a range must be a (min, max) pair of integers, "
                    "e.g. num_workers=(2, 4)."
                )
            lo, hi = n
            if lo < 1:
                raise ConfigError(
                    f"ScalingConfig.num_workers={n!r}: min must be at least 1, e.g. num_workers=(1, {max(hi, 1)})."
                )
            if lo > hi:
                raise ConfigError(
                    f"ScalingConfig.num_workers={n!r}: min {lo} is greater than max {hi}; "
                    f"write num_workers=({hi}, {lo})."
                )
        elif not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(
                f"ScalingConfig.num_workers={n!r}: need a number of workers (0: Ray's local mode, one worker "
                "here), or a (min, max) range, e.g. num_workers=2 or num_workers=(1, 2)."
            )
        if self.placement_strategy not in _PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"ScalingConfig.placement_strategy={self.placement_strategy!r}: use one of "
                f"{', '.join(_PLACEMENT_STRATEGIES)}."
            )
        for key, amount in (self.resources_per_worker or {}).items():
            if not isinstance(amount, (int, float)) or amount < 0:
                raise ConfigError(
                    f"ScalingConfig.resources_per_worker[{key!r}]={amount!r}: amounts must be numbers >= 0."
                )

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else max(self.num_workers, 1)

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else max(self.num_workers, 1)

    @property
    def total_resources(self) -> dict[str, float]:
        """The Ray resources the run's workers ask for at most (`max` workers of an elastic run), as in
        Ray Train (the supervisor asks for none)."""
        return {k: v * self.max_workers for k, v in self.worker_resources().items() if v}

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources one worker actor asks for (1 CPU, plus 1 GPU with use_gpu)."""
        resources = {"CPU": 1.0}
        if self.use_gpu:
            resources["GPU"] = 1.0
        resources.update({k: float(v) for k, v in (self.resources_per_worker or {}).items()})
        return resources


@_ray_only({
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


@_ray_only({}, deprecated={
    "checkpoint_frequency": "report a checkpoint when you want one (store only every n-th with "
                            "persist_every_n_reports=n)",
    "checkpoint_at_end": "report a checkpoint at the end of the loop (the last one reported is always stored)",
})
@dataclass(frozen=True)
class CheckpointConfig:
    """Which persisted checkpoints to keep: the `num_to_keep` best by a reported metric, or the newest.

    By default every reported checkpoint is persisted, in order, none skipped (Ray Train's contract).
    Setting `persist_every_n_reports` or `persist_interval_s` opts into a cadence: the checkpoints
    between are kept in workers' memory only, and one waiting for an upload may be replaced by a newer.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    persist_every_n_reports: int | None = None
    """Persist every Nth reported checkpoint to storage (the others live in workers' memory only)."""
    persist_interval_s: float | None = None
    """Persist a reported checkpoint when this long has passed since the last persisted one."""

    def __post_init__(self) -> None:
        n = self.persist_every_n_reports
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ConfigError(f"CheckpointConfig.persist_every_n_reports={n!r}: use an integer >= 1, or None.")
        if self.persist_interval_s is not None and not self.persist_interval_s > 0:
            raise ConfigError(
                f"CheckpointConfig.persist_interval_s={self.persist_interval_s!r}: use a number of seconds > 0, or None."
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
        return self.persist_every_n_reports is None and self.persist_interval_s is None

    @property
    def replaceable(self) -> bool:
        """May a newer checkpoint replace a chosen one still waiting for its upload? Under a cadence,
        unless checkpoints are kept by score (skipping one could lose the best)."""
        return not self.stores_every and self.checkpoint_score_attribute is None

    def persist_due(self, reports_since: int, since_stored_s: float) -> bool:
        """Is a reported checkpoint due to be stored, the `reports_since`-th since the last one stored,
        `since_stored_s` after it? Always, without a cadence. The supervisor asks for the checkpoints
        it decides on (supervisor/cadence.py); the ranks ask for the live dict parts they hold
        (worker/session.py), which must be copied before the loop goes on, so they decide at the
        report's barrier and tell the supervisor."""
        if self.stores_every:
            return True
        n, interval = self.persist_every_n_reports, self.persist_interval_s
        return (n is not None and reports_since >= n) or (interval is not None and since_stored_s >= interval)


@dataclass(frozen=True)
class ElasticConfig:
    """Timeouts and intervals of the elastic runtime. Defaults suit a LAN cluster."""

    heartbeat_interval_s: float = 0.5
    """How often a worker tells the supervisor it is alive."""
    heartbeat_timeout_s: float = 5.0
    """A worker silent for this long is declared lost and fenced out."""
    heartbeat_udp: bool = True
    """Heartbeats travel as UDP datagrams to the supervisor (`supervisor/heartbeats.py`): tens of
    microseconds of its CPU each, against about a millisecond for a Ray call, so one supervisor keeps up
    with 10,000 workers. False: every heartbeat is a Ray call (where UDP cannot pass between machines)."""
    heartbeat_reply_timeout_s: float = 1.0
    """A worker whose datagrams went unanswered this long heartbeats through a Ray call instead (UDP
    blocked, or the supervisor was restarted on another port: the call's reply names the new one)."""
    report_interval_s: float = 0.25
    """A `report()` at which no rank reported a checkpoint does not wait for the supervisor: each
    worker sends such reports in one call per this interval (`worker/report_sender.py`). It is how
    late the supervisor (progress, callbacks, metrics) may learn of them."""
    min_workers_timeout_s: float = 60.0
    """How long the run waits below `min` workers for capacity before it fails."""
    initial_placement_timeout_s: float = 30.0
    """How long the first generation waits for the workers the cluster can place to come up."""
    drain_timeout_s: float = 30.0
    """How long a restart waits for survivors to leave the old generation before dropping them (and
    ending their process: a hung one would keep its slot). Must exceed `rendezvous_timeout_s`."""
    probe_timeout_s: float = 2.0
    """How long a liveness probe of a member may take after a collective fails."""
    rendezvous_timeout_s: float = 20.0
    """How long a new process group waits for all its ranks to join."""
    collective_timeout_s: float = 300.0
    """Per-operation timeout of the torch.distributed process group."""
    process_group_destroy_timeout_s: float = 10.0
    """How long a worker's next join waits for the previous generation's group to be torn down (off
    the training thread) before it goes on without it. Must be below `rendezvous_timeout_s`."""
    supervisor_max_restarts: int = 3
    """How often Ray restarts a supervisor that died; the restarted one adopts the workers (-1: always)."""
    supervisor_adoption_timeout_s: float = 10.0
    """How long a restarted supervisor waits for each worker to describe itself before replacing it."""
    progress_timeout_s: float | None = None
    """The progress watchdog: a generation in which no member reported for this long is stalled; the
    members behind the others (or, if all stand alike, those that do not leave when the generation is
    aborted) are hung: dropped, ended and replaced. Heartbeats prove the process, this the loop. Set
    it above the longest gap between two reports (the first one included); None turns it off (a
    collective in the loop still fails after `collective_timeout_s`)."""
    straggler_factor: float = 2.0
    """A rank whose step time (its loop's time between reports, outside `report()`) exceeds this many
    times the median of its peers' ... (`supervisor/pace.py`)."""
    straggler_min_excess_s: float = 0.05
    """... and that median by at least this much ..."""
    straggler_reports: int = 5
    """... at this many reports in a row is flagged a straggler (an event; cleared when it catches up)."""
    memory_growth_reports: int = 20
    """A worker whose RSS rose at this many reports in a row ..."""
    memory_growth_min_mb: float = 256.0
    """... by at least this much in all is flagged for growing memory (an event)."""
    control_tick_s: float = 0.25
    """The supervisor's state machine re-checks timers at least this often."""
    checkpoints_in_memory: int = 2
    """Reported checkpoints each worker keeps in memory for in-place recovery."""
    replicate_checkpoints: bool = True
    """Each reported part is also kept in the memory of the next rank (`worker/replicator.py`), so losing
    one worker loses no in-memory checkpoint; it doubles the memory checkpoints take."""
    snapshot_memory_retain_mb: int | None = 512
    """Freed heap memory a worker keeps for its next checkpoint snapshots (glibc only; see
    `worker/allocator.py`): snapshots then skip faulting in fresh pages. None keeps glibc's defaults."""
    storage_retry_initial_s: float = 0.2
    """First backoff after a transient storage error; it doubles (with jitter) per retry."""
    storage_retry_max_s: float = 10.0
    """Longest backoff between two retries of a storage operation."""
    storage_retry_deadline_s: float = 120.0
    """How long one storage operation is retried; then that checkpoint is given up (training goes on)."""
    persist_flush_timeout_s: float = 600.0
    """How long a finishing worker waits for its last checkpoint to reach storage."""
    max_queued_uploads: int = 2
    """Reported checkpoint parts a worker keeps waiting for their upload. When storage falls behind the
    reports, a report waits for room (memory stays bounded; the wait is a `report_waited_for_upload`
    event) rather than drop a checkpoint."""
    preemption_sigterm: bool = True
    """Treat SIGTERM to a worker process as a preemption notice (the worker leaves at the next report) rather than a crash."""
    preemption_sigterm_grace_s: float = 30.0
    """How long a worker stays up after SIGTERM to hand its state over, before it exits as SIGTERM asks."""
    preemption_pollers: tuple[str, ...] = ()
    """Cloud metadata endpoints to poll for preemption notices: any of "aws", "gcp", "azure"."""
    preemption_metadata_url: str | None = None
    """Base URL of the metadata service, instead of each cloud's own (a proxy, or a test server)."""
    preemption_poll_interval_s: float = 1.0
    """How often the pollers (and the supervisor, for Ray's draining nodes) ask for a preemption notice."""
    preemption_info_timeout_s: float = 300.0
    """How long `get_preemption_info()` (a barrier) waits for every rank to call it; then it raises in
    the loop, saying that every rank must call it alike."""
    watch_ray_drains: bool = True
    """Treat a node that Ray drains (`ray drain-node`, KubeRay's SIGTERM handling, the autoscaler) as a
    preemption notice for the workers on it."""
    event_log_interval_s: float = 1.0
    """How often the supervisor writes the events recorded since to the run's `events.jsonl`
    (`run_folder/events.py`): the delay before an event can be read from storage."""
    metrics_interval_s: float = 5.0
    """How often the supervisor samples the metrics that change between events (heartbeat ages,
    goodput, the step rate) for Prometheus (`supervisor/metrics.py`); Ray's agent exports every 10 s."""
    verbosity: int = 1
    """What `fit()` shows as the run goes (`progress.py`): 0 nothing, 1 a live status line and the
    events that change the run, 2 also every report and every event. (Ray Train deprecated its
    `RunConfig(verbose=...)`; this is ours.)"""
    progress_interval_s: float = 10.0
    """When stdout is not a terminal, how often `fit()` prints a status line (`verbosity` >= 1)."""
    run_record_interval_s: float = 5.0
    """How often the driver writes the run record (rank 0's metrics) to the run's folder
    while the run goes on (`run_folder/record.py`), so `Result.from_path` finds them if the driver dies; also
    the longest one of its calls for new reports waits."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and not (f.name in _OPTIONAL_S and getattr(self, f.name) is None):
                _check_positive("ElasticConfig", f.name, getattr(self, f.name))
        if not self.straggler_factor > 1:
            raise ConfigError(f"ElasticConfig.straggler_factor={self.straggler_factor!r} must be above 1: a rank "
                              "is a straggler when its step takes that many times its peers' median.")
        for name in ("straggler_reports", "memory_growth_reports"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"ElasticConfig.{name}={getattr(self, name)!r}: use a whole number of reports >= 1.")
        if self.verbosity not in (0, 1, 2):
            raise ConfigError(f"ElasticConfig.verbosity={self.verbosity!r}: use 0 (quiet), 1 (status and events) "
                              "or 2 (all).")
        if self.memory_growth_min_mb < 0:
            raise ConfigError(f"ElasticConfig.memory_growth_min_mb={self.memory_growth_min_mb!r} must be >= 0.")
        if self.process_group_destroy_timeout_s >= self.rendezvous_timeout_s:
            raise ConfigError(
                f"ElasticConfig.process_group_destroy_timeout_s={self.process_group_destroy_timeout_s} must be "
                f"below rendezvous_timeout_s={self.rendezvous_timeout_s}: a worker still tearing its old group "
                "down would make its peers' rendezvous time out. Lower it, or raise rendezvous_timeout_s."
            )
        if self.drain_timeout_s <= self.rendezvous_timeout_s:
            raise ConfigError(
                f"ElasticConfig.drain_timeout_s={self.drain_timeout_s} must exceed rendezvous_timeout_s="
                f"{self.rendezvous_timeout_s}: a survivor still joining a group that lost a peer leaves only "
                "after the rendezvous times out, and would be dropped as hung. Raise drain_timeout_s."
            )
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"ElasticConfig.heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed twice "
                f"heartbeat_interval_s={self.heartbeat_interval_s}, or healthy workers would be dropped."
            )
        if self.heartbeat_udp and not (self.heartbeat_interval_s < self.heartbeat_reply_timeout_s
                                       < self.heartbeat_timeout_s - 2 * self.heartbeat_interval_s):
            raise ConfigError(
                f"ElasticConfig.heartbeat_reply_timeout_s={self.heartbeat_reply_timeout_s} must exceed "
                f"heartbeat_interval_s={self.heartbeat_interval_s} (a reply takes a round trip) and stay below "
                f"heartbeat_timeout_s - 2 * heartbeat_interval_s = "
                f"{self.heartbeat_timeout_s - 2 * self.heartbeat_interval_s:g} (a worker whose datagrams are lost "
                "must fall back to Ray calls before it is declared lost). Adjust it, or set heartbeat_udp=False."
            )
        if self.progress_timeout_s is not None and self.report_interval_s >= self.progress_timeout_s:
            raise ConfigError(
                f"ElasticConfig.report_interval_s={self.report_interval_s} must be below progress_timeout_s="
                f"{self.progress_timeout_s}: the watchdog would take the reports sent that late for a stalled loop."
            )
        unknown = set(self.preemption_pollers) - {"aws", "gcp", "azure"}
        if unknown:
            raise ConfigError(
                f"ElasticConfig.preemption_pollers has {sorted(unknown)}: use any of 'aws', 'gcp', 'azure'."
            )
        if self.supervisor_max_restarts < -1:
            raise ConfigError("ElasticConfig.supervisor_max_restarts must be -1 (always restart), 0 or more.")
        if self.max_queued_uploads < 1:
            raise ConfigError("ElasticConfig.max_queued_uploads must be at least 1.")
        if self.checkpoints_in_memory < 1:
            raise ConfigError("ElasticConfig.checkpoints_in_memory must be at least 1.")
        if self.snapshot_memory_retain_mb is not None and self.snapshot_memory_retain_mb < 1:
            raise ConfigError("ElasticConfig.snapshot_memory_retain_mb must be at least 1, or None to keep "
                              "the allocator's defaults.")


def _is_filesystem(value: Any) -> bool:
    """Is `value` a filesystem that storage can be on (fsspec's, or pyarrow's as in Ray)?"""
    import fsspec

    if isinstance(value, fsspec.AbstractFileSystem):
        return True
    import pyarrow.fs

    return isinstance(value, pyarrow.fs.FileSystem)


@_ray_only({
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
    """A filesystem (pyarrow's, as in Ray, or fsspec's) on which `storage_path` is a path."""

    def __post_init__(self) -> None:
        if self.storage_filesystem is not None:
            if not _is_filesystem(self.storage_filesystem):
                raise ConfigError("RunConfig(storage_filesystem=...) must be a pyarrow.fs.FileSystem or an fsspec "
                                  f"filesystem, got {type(self.storage_filesystem).__name__}.")
            if not self.storage_path:
                raise ConfigError("RunConfig(storage_filesystem=...) needs storage_path: the path on that "
                                  "filesystem under which the run's folder is made.")
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
                raise ConfigError(f"RunConfig.{attr} must be a {cls.__name__}, got {type(value).__name__}.")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ConfigError(f"RunConfig.name={self.name!r}: use a non-empty name without '/'.")

    def resolved_storage_path(self) -> str:
        """The storage root: `storage_path`, else $ELASTIC_TRAIN_STORAGE, else ~/elastic_train_results."""
        return (
            self.storage_path
            or os.environ.get("ELASTIC_TRAIN_STORAGE")
            or os.path.join(os.path.expanduser("~"), "elastic_train_results")
        )


__all__ = [
    "ScalingConfig",
    "FailureConfig",
    "CheckpointConfig",
    "ElasticConfig",
    "RunConfig",
]
