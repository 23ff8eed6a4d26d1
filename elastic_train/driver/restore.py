"""Going on with a stored run (`TorchTrainer.restore`): whether a folder holds a run, and the
arguments of the trainer that goes on with it, read from the run's `trainer.pkl` unless given."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import RunConfig
from elastic_train.driver.arguments import as_config
from elastic_train.errors import ConfigError
from elastic_train.run_folder.record import RUN, load_trainer, read_json


def is_run(storage: RunStorage) -> bool:
    """Does the folder hold a run: its record, or a committed checkpoint?"""
    return read_json(storage, RUN, None) is not None or storage.newest_committed() is not None


def restored_arguments(
    owner: str,
    path: str,
    train_loop_per_worker: Callable[..., Any] | None,
    storage_options: Mapping[str, Any] | None,
    storage_filesystem: Any,
    kwargs: Mapping[str, Any],
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The loop and the other arguments of a trainer that goes on with the run at `path` (see
    `DataParallelTrainer.restore`, which `owner` names in errors). `kwargs` replace the stored
    arguments; the run config gets the run's name and storage, and the credentials passed here."""
    kwargs = dict(kwargs)
    run_config = kwargs.pop("run_config", None)
    run_config = as_config(RunConfig, run_config, "run_config") if run_config is not None else None
    if storage_options is None and run_config is not None:
        storage_options = run_config.storage_options
    if storage_filesystem is None and run_config is not None:
        storage_filesystem = run_config.storage_filesystem
    storage = RunStorage.at(path, storage_options, filesystem=storage_filesystem)
    if not is_run(storage):
        raise ConfigError(
            f"{owner}.restore({path!r}): neither a run record ({RUN}) nor a committed checkpoint there. Pass "
            "the folder of an earlier run (its Result.path), with the storage_options it used."
        )
    if train_loop_per_worker is None:
        stored = load_trainer(storage)
        train_loop_per_worker = stored.pop("train_loop_per_worker")
        stored_run_config = stored.pop("run_config")
        run_config = run_config or stored_run_config
        kwargs = {**stored, **kwargs}
    run_config = dataclasses.replace(run_config or RunConfig(), storage_path=storage.storage_path,
                                     name=storage.name, storage_options=storage_options,
                                     storage_filesystem=storage_filesystem)
    return train_loop_per_worker, {"run_config": run_config, **kwargs}
