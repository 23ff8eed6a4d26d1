"""What a worker holds in memory for the run: its own checkpoint parts, and the replicas of its
peers' parts it keeps (replicator.py copies each of its own parts to its buddy). Both outlive a
generation: the next one resumes from them, and peers read them through the worker's actor."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.memory import CheckpointMemory, Part
from elastic_train.worker.replicator import Facts, Replicator

SendReplica = Callable[[Any, HeldCheckpoint, dict[str, bytes]], None]  # (peer, held, files): into the peer's memory


class Holdings:
    def __init__(self, checkpoints_in_memory: int, send_replica: SendReplica):
        self.own = CheckpointMemory(checkpoints_in_memory)
        self.replicas = CheckpointMemory(checkpoints_in_memory)  # peers' parts
        self._replicator = Replicator(send_replica)

    def read(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Files of checkpoint `index` of `generation`, from this worker's own part or from the replica
        it keeps for a peer."""
        files = self.own.find(generation, index, names)
        if len(files) < len(names):
            files.update(self.replicas.get(generation, index, [n for n in names if n not in files]))
        return files

    def facts(self, generation: int, index: int, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The facts of `names` of checkpoint `index` of `generation`, as this worker holds them."""
        known = {**self.replicas.facts(generation, index), **self.own.facts(generation, index)}
        return {name: known[name] for name in names if name in known}

    def hold(self, held: HeldCheckpoint, part: Part, facts: Facts, buddy: Any) -> None:
        """A reported part: held in memory, and its files copied to `buddy` (None: none) in the
        background, with their facts (on their way). A live part is not copied: its tensors change
        under the copy (live_part.py); unless it is private (a sharded model's share, a copy already)."""
        self.own.put(held, part, facts=facts)
        if buddy is not None and (isinstance(part, dict) or part.private):
            self._replicator.submit(buddy, held, part, facts)

    def forget_after(self, generation: int, index: int) -> None:
        """A generation resumes from report `index` of `generation`: the later ones are redone."""
        self.own.forget_after(generation, index)
        self.replicas.forget_after(generation, index)

    def replication_s(self) -> float | None:
        """How long the last copy to the buddy took; None while one is on its way."""
        return self._replicator.last_s()

    def listed(self) -> list[HeldCheckpoint]:
        """Everything held, own parts and replicas, for the supervisor."""
        return self.own.holdings() + self.replicas.holdings()

    def close(self) -> None:
        self._replicator.close()
