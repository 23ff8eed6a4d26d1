"""`ElasticConfig`: the elastic runtime's own timeouts and intervals (heartbeats, restarts, the
progress watchdog, checkpoint memory and uploads, preemption notices, what `fit()` shows), checked
alone and against one another on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic_train.config.renamed import renamed
from elastic_train.errors import ConfigError

_OPTIONAL_S = ("progress_timeout_s",)  # None turns these off
_MAY_BE_ZERO_S = ("part_safe_wait_s", "process_group_destroy_timeout_s", "warm_spares_after_s")  # 0: not at all


def _check_positive(owner: str, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive number of seconds, got {value!r}.")


@renamed({"persist_flush_timeout_s": "store_flush_timeout_s"})
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
    worker sends such reports in one call per this interval (`worker/report/sender.py`). It is how
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
    """How long a new process group waits for all its ranks to join; a rank whose peer dies as the group
    forms leaves it within this (gloo: `worker/group/gloo.py`)."""
    collective_timeout_s: float = 300.0
    """Per-operation timeout of the torch.distributed process group."""
    process_group_destroy_timeout_s: float = 10.0
    """How long a worker's next join waits for the previous generation's group to be torn down (off
    the training thread) before it goes on without it (0: not at all; Ray's TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
    sets it). Must be below `rendezvous_timeout_s`."""
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
    times the median of its peers' ... (`supervisor/watch/pace.py`)."""
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
    recover_in_place: bool = True
    """A peer lost during a step's gradient reduction does not unwind the loop: the survivors complete
    the step among themselves and the loop goes on where it was (`worker/group/reduction.py`), on gloo, in a
    loop that draws its data from `prepare_data_loader` and wraps its model with `prepare_model`.
    `get_context()` then answers the new rank and world size: a loop that uses a rank or world size it
    read before its loop (to scale its loss, to pick the rank that saves) needs False, which re-enters
    the loop from its newest checkpoint at every recovery, as Ray Train does."""
    warm_spares_per_node: int = 1
    """Worker processes kept ready beside a run at its full size, on each node that hosts its workers:
    started, torch and the loop imported, parked. A worker process lost on a live node is replaced by
    the spare there at once, the run back at full size in a fraction of a second instead of a new
    process's start (seconds). Each worker runs in a placement group of one bundle that the run keeps
    when its process dies, so no other job can take what it held: the spare, which holds nothing, takes
    it over. Its cost is its memory (a process with torch imported). Where workers need a GPU, the
    spare holds one of its own from its start, its CUDA context made, on nodes with a GPU free (a run
    with datasets leaves a CPU beside it for Ray Data's tasks). None where the run has a label selector
    per worker. 0: none."""
    warm_spares_after_s: float = 10.0
    """Warm spares are started once the run is this old: a spare's start (a process, torch and the
    loop imported: 2-3 CPU-seconds here) then competes with neither the workers' own start nor their
    first steps, and a run that ends sooner starts none. A worker lost before its node's spare is
    ready is replaced by a process started then, as with no spare."""
    checkpoints_in_memory: int = 2
    """Reported checkpoints each worker keeps in memory for in-place recovery."""
    sharded_state_budget: float = 0.05
    """The share of the loop's time that keeping a sharded model's state (FSDP2 with `live_state=True`:
    `worker/hold/sharded_state.py`) may take. A report copies each rank's share, and sends it to the buddy,
    once the time since the last copy is at least that copy's cost over this fraction (1.0: at every
    report); a lost worker's recovery redoes the steps since the last copy."""
    replicate_checkpoints: bool = True
    """Each reported part is also kept in the memory of the next rank (`worker/hold/replicator.py`), so losing
    one worker loses no in-memory checkpoint; it doubles the memory checkpoints take."""
    part_safe_wait_s: float = 0.05
    """A report of a folder's files that the ranks store themselves (no cadence: every checkpoint is
    stored), whose part did not go to the buddy inside the report (over 1 MB, an NCCL group, no
    buddy: worker/report/part_exchange.py), returns once that part is safe beyond its process, copied to
    the buddy or stored, whichever comes first, or after this long: a worker lost right after its
    report then loses none of it, and at most one step is redone. A part that takes longer goes on
    in the background. 0 does not wait: a worker lost within the few milliseconds it takes may lose
    that report's part (one more step redone)."""
    snapshot_memory_retain_mb: int | None = 512
    """Freed heap memory a worker keeps for its next checkpoint snapshots (glibc only; see
    `worker/hold/allocator.py`): snapshots then skip faulting in fresh pages. None keeps glibc's defaults."""
    storage_retry_initial_s: float = 0.2
    """First backoff after a transient storage error; it doubles (with jitter) per retry."""
    storage_retry_max_s: float = 10.0
    """Longest backoff between two retries of a storage operation."""
    storage_retry_deadline_s: float = 120.0
    """How long one storage operation is retried; then that checkpoint is given up (training goes on)."""
    store_flush_timeout_s: float = 600.0
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
    (`run_folder/event_log.py`): the delay before an event can be read from storage."""
    metrics_interval_s: float = 5.0
    """How often the supervisor samples the metrics that change between events (heartbeat ages,
    goodput, the step rate) for Prometheus (`supervisor/watch/metrics.py`); Ray's agent exports every 10 s."""
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
            value = getattr(self, f.name)
            if f.name in _MAY_BE_ZERO_S and value == 0 or f.name in _OPTIONAL_S and value is None:
                continue
            if f.name in _MAY_BE_ZERO_S and not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"ElasticConfig.{f.name} must be 0 (no wait) or a positive number of seconds, "
                                  f"got {value!r}.")
            if f.name.endswith("_s"):
                _check_positive("ElasticConfig", f.name, value)
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
        if not isinstance(self.warm_spares_per_node, int) or self.warm_spares_per_node < 0:
            raise ConfigError(f"ElasticConfig.warm_spares_per_node={self.warm_spares_per_node!r}: use a whole number "
                              ">= 0 (0: no warm spares).")
        if self.checkpoints_in_memory < 1:
            raise ConfigError("ElasticConfig.checkpoints_in_memory must be at least 1.")
        if not 0 < self.sharded_state_budget <= 1:
            raise ConfigError("ElasticConfig.sharded_state_budget is a fraction of the loop's time: more than 0, "
                              "at most 1 (a copy of a sharded model's kept state at every report).")
        if self.snapshot_memory_retain_mb is not None and self.snapshot_memory_retain_mb < 1:
            raise ConfigError("ElasticConfig.snapshot_memory_retain_mb must be at least 1, or None to keep "
                              "the allocator's defaults.")
