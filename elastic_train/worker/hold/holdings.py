"""What a worker holds in memory for the run: its own checkpoint parts, and the replicas of its
peers' parts it keeps (worker/hold/replicator.py copies each of its own parts to its buddy). Both outlive a
generation: the next one resumes from them, and peers read them through the worker's actor.

A sharded model's shares (worker/hold/sharded_state.py) are the exception to keeping the newest few of each: a
buddy keeps one share of its peer at rest. Its older one is needed only until every rank's newer
share has reached its buddy; from then on the newer report is whole wherever a rank or its buddy
survives, and the older one adds nothing (docs/sharded_state.md)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.hold.parts import HeldParts, Part
from elastic_train.worker.hold.replicator import Facts, Replicator

SendReplica = Callable[[Any, HeldCheckpoint, dict[str, bytes]], None]  # (peer, held, files): into the peer's memory


class Holdings:
    def __init__(self, checkpoints_in_memory: int, send_replica: SendReplica):
        self.own = HeldParts(checkpoints_in_memory)
        self.replicas = HeldParts(checkpoints_in_memory)  # peers' parts
        self._replicator = Replicator(send_replica)
        self._newest_share: tuple[int, int] | None = None  # (generation, index) of this worker's newest own share
        self._replicated: tuple[int, int] | None = None  # the newest report every rank's share of reached its buddy

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

    def hold(self, held: HeldCheckpoint, part: Part, facts: Facts, buddy: Any,
             safe: threading.Event | None = None) -> None:
        """A reported part: held in memory, and its files copied to `buddy` (None: none) in the
        background, with their facts (on their way); `safe` (set once storage holds it) is set once the
        buddy holds it, if storage did not first (worker/hold/replicator.py). A live part is not copied: its tensors
        change under the copy (worker/hold/live_part.py); unless it is private (a sharded model's share, a copy already)."""
        self.own.put(held, part, facts=facts)
        if not isinstance(part, dict) and part.private:
            self._newest_share = (held.generation, held.index)
        if buddy is not None and (isinstance(part, dict) or part.private):
            self._replicator.submit(buddy, held, part, facts, safe)

    def hold_replica(self, held: HeldCheckpoint, files: dict[str, bytes], running: bool) -> None:
        """Keep a peer's part. While this worker's generation runs (`running`), older parts give way:
        the oldest beyond the newest few, and a peer's shares that a replicated report made redundant."""
        self.replicas.put(held, files, evict=running)
        if running and self._replicated is not None:
            self.replicas.drop_shares_before(self._replicated)

    def share_delivered(self) -> bool:
        """Has this worker's newest share (a sharded model's, copied at a report) reached its buddy?"""
        return self._newest_share is not None and self._replicator.delivered() == self._newest_share

    def replicated(self, generation: int) -> None:
        """Every rank of `generation` has its newest share at its buddy (agreed at a report:
        worker/report/share_copies.py `ShareCopies.due`): the shares this worker keeps for its peer from before that report are dropped.
        Only a copy of `generation` counts: an older one's ranks were not all in the agreement."""
        if self._newest_share is not None and self._newest_share[0] == generation:
            self._replicated = self._newest_share
            self.replicas.drop_shares_before(self._replicated)

    def forget_after(self, generation: int, index: int) -> None:
        """A generation resumes from report `index` of `generation`: the later ones are redone (and what
        was agreed replicated in a generation before counts no more)."""
        self._replicated = None
        self.own.forget_after(generation, index)
        self.replicas.forget_after(generation, index)

    def replication_s(self) -> float | None:
        """How long the last copy to the buddy took; None while one is on its way."""
        return self._replicator.last_s()

    def listed(self) -> list[HeldCheckpoint]:
        """Everything held, own parts and replicas, for the supervisor."""
        return self.own.holdings() + self.replicas.holdings()

    def __str__(self) -> str:
        return (f"reports {self.own.keys()} of its own, and {self.replicas.keys()} of its peers' "
                f"({self.replicas.file_bytes() / 2**20:.1f} MB)")

    def close(self) -> None:
        self._replicator.close()
