"""The loop's data loaders, as its session drives them: prepared DataLoaders (torch/data.py) and
dataset shards (`get_dataset_shard`, ingest/shard.py). Each keeps an epoch's cursor
(ingest/cursor.py): told when every rank trained what was drawn, re-sharded when the loop goes on in
place, its state reported with every report and resumed from the report a generation starts from."""

from __future__ import annotations

from typing import Any, Mapping, Protocol


class StatefulLoader(Protocol):
    """A loader whose epoch position survives a resize."""

    def loader_state(self) -> dict[str, Any]:
        """Its cursor, as a report records it."""

    def reported(self, carries_state: bool) -> None:
        """A report recorded `loader_state()`; `carries_state`: a resume may start from it."""

    def trained(self) -> None:
        """Every rank trained the batches drawn so far: the step's gradients were reduced, or a report
        (which follows the step's collectives) was made."""

    def reformed(self, rank: int, world_size: int, previous_ranks: tuple[int, ...]) -> None:
        """The loop goes on in place as `rank` of `world_size` (`previous_ranks`: each new rank's previous
        one): re-shard the rest of the epoch, with the shares the lost ranks did not complete since the
        last `trained`."""


class Loaders:
    """A generation's loaders, in the order the loop made them (the order their states are reported)."""

    def __init__(self, resumed: list[dict[str, Any]], datasets: Mapping[str, Any], data_context: Any = None):
        """`data_context`: the driver's `ray.data.DataContext`, the loop's from its start, as Ray Train
        sets it in each worker of a run with datasets."""
        self._resumed = resumed  # the states of the report the generation resumes from
        self._datasets = datasets  # TorchTrainer(datasets=): ingest/config.py DatasetSource by name
        if data_context is not None:
            from ray.data import DataContext

            DataContext._set_current(data_context)
        self._loaders: list[StatefulLoader] = []
        self._keys: list[str | None] = []  # each loader's dataset (None: a prepared DataLoader)
        self._shards: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._loaders)

    def register(self, loader: StatefulLoader, dataset: str | None = None) -> dict[str, Any] | None:
        """Track `loader` (a shard of `dataset`, or a prepared DataLoader); returns the state it resumes
        from, if any: its dataset's, or the n-th DataLoader's for the n-th DataLoader."""
        states = [state for state in self._resumed if state.get("dataset") == dataset]
        position = self._keys.count(dataset)
        self._loaders.append(loader)
        self._keys.append(dataset)
        return states[position] if position < len(states) else None

    def dataset_shard(self, name: str | None, rank: int, world_size: int) -> Any:
        """`get_dataset_shard(name)`: one iterator a dataset for the generation; None without datasets."""
        if not self._datasets:
            return None
        if name not in self._datasets:
            raise KeyError(f"get_dataset_shard({name!r}): the trainer's datasets are {sorted(self._datasets)}.")
        if name not in self._shards:
            source = self._datasets[name]
            shard = self._shards[name] = source.iterator(name, rank, world_size)
            if source.split:
                shard.resume_from(self.register(shard, name))
        return self._shards[name]

    def trained(self) -> None:
        for loader in self._loaders:
            loader.trained()

    def reformed(self, rank: int, world_size: int, previous_ranks: tuple[int, ...]) -> None:
        for loader in self._loaders:
            loader.reformed(rank, world_size, previous_ranks)

    def states(self) -> list[dict[str, Any]]:
        return [loader.loader_state() for loader in self._loaders]

    def reported(self, carries_state: bool) -> None:
        for loader in self._loaders:
            loader.reported(carries_state)


__all__ = ["Loaders", "StatefulLoader"]
