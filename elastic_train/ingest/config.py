"""What a run makes of `TorchTrainer(datasets=..., dataset_config=DataConfig(...))`: which datasets
are split across the ranks (each served by a coordinator, coordinator.py) and which every rank
iterates whole, each with its Ray Data execution options.

`DataConfig` is Ray's (`ray.train.DataConfig` is accepted as well). Where we differ: a split
dataset's execution preserves order (its epoch is replayed in the same order by a restarted
coordinator: exactly once needs it); `enable_shard_locality` is accepted and has no effect (a
rank's rows come from whichever node holds them); a `configure()` of one's own is refused (it
splits for a world size that changes here).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import ray
from ray.train._internal.data_config import DataConfig as _RayDataConfig

from elastic_train.errors import ConfigError

logger = logging.getLogger(__name__)

TRAIN_DATASET_KEY = "train"


class DataConfig(_RayDataConfig):
    """Ray Train's `DataConfig`: `datasets_to_split` ("all" or names) and `execution_options` (one
    `ExecutionOptions`, or one a dataset by name). See this module's docstring for where we differ."""


@dataclass(frozen=True)
class DatasetSource:
    """What a worker needs to give its loop one dataset."""

    dataset: Any  # the dataset, with its execution options
    split: bool  # split across the ranks (else every rank iterates it whole) ...
    coordinator: Any = None  # ... by the actor serving its epochs (driver/launch.py)

    def iterator(self, name: str, rank: int, world_size: int) -> Any:
        """Rank `rank`'s iterator (ingest/shard.py); Ray's own over all of it where it is not split."""
        if not self.split:
            return self.dataset.iterator()
        from elastic_train.ingest.shard import ElasticDataIterator

        return ElasticDataIterator(name, self.coordinator, self.dataset, rank, world_size)


def check_datasets(datasets: Mapping[str, Any], config: Any) -> DataConfig | _RayDataConfig:
    """Refuse what cannot run, before any actor starts; returns the config to run with."""
    from ray.data import Dataset

    config = config if config is not None else DataConfig()
    if not isinstance(config, _RayDataConfig):
        raise ConfigError(f"dataset_config must be an elastic_train.DataConfig, got {type(config).__name__}.")
    if type(config).configure is not _RayDataConfig.configure:
        raise ConfigError(
            f"dataset_config: {type(config).__name__} overrides DataConfig.configure(), which splits the datasets "
            "once for a fixed number of workers; here the ranks change while the run goes on. Use DataConfig's "
            "fields (datasets_to_split, execution_options) and preprocess in the dataset (map_batches).")
    for name, dataset in datasets.items():
        if not isinstance(name, str):
            raise ConfigError(f"datasets: name each dataset with a str, got {name!r}.")
        if not isinstance(dataset, Dataset) and not callable(dataset):
            raise ConfigError(f"datasets[{name!r}] must be a ray.data.Dataset (or a function returning one), got "
                              f"{type(dataset).__name__}.")
    unknown = sorted(set(_split_names(config, datasets)) - set(datasets))
    if unknown:
        raise ConfigError(f"DataConfig(datasets_to_split={unknown}) names no dataset: the trainer has "
                          f"{sorted(datasets)}.")
    return config


def prepare_datasets(datasets: Mapping[str, Any], config: DataConfig | _RayDataConfig,
                     workers_cpus: float) -> dict[str, DatasetSource]:
    """Each dataset with its execution options, split or not (its coordinator still to start).
    `workers_cpus`: what the most workers the run may have take."""
    spare = ray.cluster_resources().get("CPU", 0) - workers_cpus
    if spare < 1:
        logger.warning(
            "the workers may take %g of the cluster's %g CPUs, leaving Ray Data's tasks (reads, map_batches) none: "
            "they wait for one, and the loop for its first batch. Leave CPUs free (ScalingConfig.num_workers, "
            "resources_per_worker) or add nodes.", workers_cpus, ray.cluster_resources().get("CPU", 0))
    split = set(_split_names(config, datasets))
    sources = {}
    for name, given in datasets.items():
        dataset = _resolved(given)
        dataset = type(dataset).copy(dataset, _deep_copy=True)  # its own context: its own options
        if dataset.name is None:
            dataset.set_name(name)
        options = config._resolve_execution_options(name)
        if name in split and not options.preserve_order:
            logger.info("dataset %r: its execution preserves order, so that an epoch replays alike", name)
            options.preserve_order = True
        dataset.context.execution_options = options
        sources[name] = DatasetSource(dataset, name in split)
    return sources


def driver_data_context() -> Any:
    """The driver's `ray.data.DataContext` as the trainer is made: each worker's loop runs under it
    (worker/loop/loaders.py), as Ray Train sets it in each worker of a run with datasets."""
    from ray.data import DataContext

    return copy.deepcopy(DataContext.get_current())


def _split_names(config: Any, datasets: Mapping[str, Any]) -> list[str]:
    names = config._datasets_to_split
    return list(datasets) if names == "all" else list(names)


def _resolved(given: Any) -> Any:
    """A dataset, or what a function given for one returns (Ray Train takes either)."""
    return given() if callable(given) else given


__all__ = ["DataConfig", "DatasetSource", "TRAIN_DATASET_KEY", "check_datasets", "prepare_datasets"]
