"""`ScalingConfig`: how many workers a run has (a fixed count, or a range it shrinks and grows in)
and the Ray resources each one asks for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from ray._private.label_utils import validate_label_selector

from elastic_train.config.ray_only import ray_only
from elastic_train.errors import ConfigError

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@ray_only({
    "use_tpu": "it trains PyTorch on GPUs (use_gpu=True) or CPUs",
    "topology": "it trains PyTorch on GPUs (use_gpu=True) or CPUs",
    "accelerator_type": "ask for it as a resource, resources_per_worker={'accelerator_type:A100': 0.001}",
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
    label_selector: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None
    """Ray's: the node labels every worker needs (one selector), or each worker slot's own (a list of
    `max` selectors; a replacement takes the slot of the worker it replaces)."""
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
        if not isinstance(self.label_selector, (Mapping, type(None))) and len(self.label_selector) != self.max_workers:
            raise ConfigError("If `label_selector` is a list, it must be the same length as `max_workers` (or "
                              "`num_workers` when fixed).")  # Ray Train's check, its message
        selectors = [self.label_selector] if isinstance(self.label_selector, Mapping) else self.label_selector or []
        if not all(isinstance(s, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in s.items())
                   for s in selectors):
            raise ConfigError(f"ScalingConfig.label_selector={self.label_selector!r}: give a dict of label values, "
                              "e.g. {'subcluster': 'my_subcluster'}, or a list of such dicts, one per worker.")
        for problem in filter(None, map(validate_label_selector, map(dict, selectors))):  # Ray's own check, at once
            raise ConfigError(f"ScalingConfig.label_selector={self.label_selector!r}: {problem}")
        for key, amount in (self.resources_per_worker or {}).items():
            if not isinstance(amount, (int, float)) or amount < 0:
                raise ConfigError(
                    f"ScalingConfig.resources_per_worker[{key!r}]={amount!r}: amounts must be numbers >= 0."
                )
        if not self.use_gpu and (self.resources_per_worker or {}).get("GPU"):  # Ray Train's check, its message
            raise ConfigError("`use_gpu` is False but `GPU` was found in `resources_per_worker`. Either set `use_gpu` "
                              "to True or remove `GPU` from `resources_per_worker`.")

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
        """The Ray resources one worker actor asks for, as Ray Train computes them: `resources_per_worker`
        as given (its zeros dropped), else 1 CPU, or with `use_gpu` 1 GPU and no CPU (a GPU node has
        fewer CPUs than GPUs to spare); `use_gpu` adds 1 GPU where none is given."""
        if self.resources_per_worker is None:
            resources = {"GPU": 1.0} if self.use_gpu else {"CPU": 1.0}
        else:
            resources = {k: float(v) for k, v in self.resources_per_worker.items() if v != 0}
        if self.use_gpu:
            resources.setdefault("GPU", 1.0)
        return resources
