"""The checkpoint parts this worker holds in memory: its own reports' and its peers' replicas, by
(generation, report index), each with its files' facts (size, checksum). Survivors resume from them,
serve them to peers and hand them over; the newest few are kept (`ElasticConfig.checkpoints_in_memory`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from concurrent.futures import CancelledError, Future
from typing import Any

from elastic_train.checkpoint.checkpoint import share_rank
from elastic_train.checkpoint.manifest import facts_soon
from elastic_train.protocol import HeldCheckpoint
from elastic_train.worker.hold.live_part import LivePart

logger = logging.getLogger(__name__)

Part = dict[str, bytes] | LivePart  # a checkpoint part's files, or a dict checkpoint's live tensors


class HeldParts:
    """The newest reported checkpoint parts, by (generation, report index): after a rewind a new
    generation reports the same indices again, and a part of an older generation must never be served
    for one of a newer. A part is its files, or a dict checkpoint's live tensors (worker/hold/live_part.py), of
    which only the newest is kept: an older one holds the same tensors, moved on. Each part's files
    have their facts (size, checksum), made with them in the background. A private live part (a sharded
    model's share, copied at its report) is kept as files are. Thread-safe."""

    def __init__(self, keep: int):
        self._keep = keep
        self._parts: OrderedDict[tuple[int, int], tuple[HeldCheckpoint, Part]] = OrderedDict()
        self._making: dict[tuple[int, int], Future[dict[str, dict[str, Any]]]] = {}  # facts on their way
        self._lock = threading.Lock()

    def put(self, held: HeldCheckpoint, part: Part, evict: bool = True,
            facts: Future[dict[str, dict[str, Any]]] | None = None) -> None:
        """Keep a part; with `evict`, drop the oldest beyond `keep`. A worker tells the supervisor
        what it holds when it parks; from then on, until its next generation, nothing is evicted.
        The facts of its files: `held.facts`, else those `facts` will give, else made now in the
        background."""
        with self._lock:
            key = (held.generation, held.index)
            merged = False
            if isinstance(part, LivePart) and not part.private:
                for older in [k for k, (_, p) in self._parts.items() if isinstance(p, LivePart) and not p.private]:
                    self._drop(older)
            elif key in self._parts and not isinstance(self._parts[key][1], LivePart):
                # more of the same checkpoint (parts handed over by two peers): merged
                known, held_files = self._parts[key]
                part = {**held_files, **part}
                held = dataclasses.replace(known, names=sorted(part), facts={**known.facts, **held.facts})
                merged = True
            self._drop(key)
            if isinstance(part, dict) and set(part) - set(held.facts):
                self._making[key] = facts if facts is not None and not merged else facts_soon(part)
            self._parts[key] = (held, part)
            while evict and len(self._parts) > self._keep:
                self._drop(next(iter(self._parts)))

    def _drop(self, key: tuple[int, int]) -> None:
        """Forget a part, and the making of its facts if not begun (caller holds the lock)."""
        self._parts.pop(key, None)
        making = self._making.pop(key, None)
        if making is not None:
            making.cancel()  # others waiting on it make the facts themselves (manifest.facts_made)

    def freeze(self) -> None:
        """The generation ended and its loop stopped writing: each live part still clean becomes its
        files (serialized once, for a peer or storage to read; their facts made with them), one no
        longer clean is dropped (the run resumes from an older checkpoint). A kept state stays as it
        is: this worker resumes from its tensors (`live_state`), a newcomer receives them over the
        group, and they are serialized only for a peer that asks over Ray (`find`)."""
        with self._lock:
            live = [(k, held, p) for k, (held, p) in self._parts.items() if isinstance(p, LivePart)]
        for key, held, part in live:
            if part.state_only and part.clean():
                continue
            files = part.files()
            with self._lock:
                if files is None:
                    logger.info("checkpoint %d of generation %d was written to after its report: not kept",
                                key[1], key[0])
                    self._drop(key)
                elif key in self._parts:
                    self._drop(key)
                    self._parts[key] = (held, files)
                    self._making[key] = facts_soon(files)

    def forget_after(self, generation: int, index: int) -> None:
        """A generation resumes from report `index` of `generation`: the later reports of that
        generation are redone (the supervisor forgot them), so their parts here are dropped rather
        than left to push out the one resumed from."""
        with self._lock:
            for key in [k for k in self._parts if k[0] == generation and k[1] > index]:
                self._drop(key)

    def drop_shares_before(self, key: tuple[int, int]) -> None:
        """Drop the parts made of sharded-model shares that are older than the newest such part held at
        or before `key` (generation, index): that one makes them redundant (worker/hold/holdings.py `replicated`)."""
        with self._lock:
            shares = [k for k, (held, _) in self._parts.items()
                      if held.names and all(share_rank(name) is not None for name in held.names)]
            settled = max((k for k in shares if k <= key), default=None)
            for older in [k for k in shares if settled is not None and k < settled]:
                self._drop(older)

    def live_state(self, generation: int, index: int) -> dict[str, Any] | None:
        """The tensors of kept state `index` of `generation` if this worker holds them unchanged since
        their report; None otherwise (the part is not held, or was written to)."""
        with self._lock:
            _, part = self._parts.get((generation, index), (None, None))
        if not isinstance(part, LivePart) or not part.state_only:
            return None
        data = part.data  # a kept state's dicts are built when first read, out of its noted tensors
        return data if part.clean() else None

    def keys(self) -> list[tuple[int, int]]:
        """(generation, index) of every part held."""
        with self._lock:
            return list(self._parts)

    def file_bytes(self) -> int:
        """The bytes of the files held (live parts' tensors not counted)."""
        with self._lock:
            return sum(len(data) for _, part in self._parts.values() if isinstance(part, dict) for data in part.values())

    def holdings(self) -> list[HeldCheckpoint]:
        """What is held, with the facts of each part's files (for the supervisor, as a worker parks or
        is adopted)."""
        return [held for held in map(self._with_facts, self.keys()) if held is not None]

    def facts(self, generation: int, index: int) -> dict[str, dict[str, Any]]:
        """The facts of the files held for checkpoint `index` of `generation` ({} if none are held)."""
        held = self._with_facts((generation, index))
        return dict(held.facts) if held is not None else {}

    def _with_facts(self, key: tuple[int, int]) -> HeldCheckpoint | None:
        """The part's record, its facts made (waited for outside the lock: the loop keeps putting)."""
        with self._lock:
            held, _ = self._parts.get(key, (None, None))
            making = self._making.get(key)
        if making is None:
            return held
        try:
            facts = making.result()
        except CancelledError:  # the part was dropped meanwhile
            facts = None
        with self._lock:
            if facts is not None and self._making.get(key) is making and key in self._parts:
                del self._making[key]
                held, part = self._parts[key]
                held = dataclasses.replace(held, facts={**facts, **held.facts})
                self._parts[key] = (held, part)
            else:
                held, _ = self._parts.get(key, (None, None))
        return held

    def get(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        found = self.find(generation, index, names)
        if len(found) < len(names):
            raise KeyError(f"checkpoint {index} of generation {generation} is no longer held by this worker")
        return found

    def find(self, generation: int, index: int, names: list[str]) -> dict[str, bytes]:
        """Those of `names` held for checkpoint `index` of `generation` (a live part's only while clean)."""
        with self._lock:
            _, part = self._parts.get((generation, index), (None, {}))
        if isinstance(part, LivePart):
            part = (part.files() or {}) if set(names) & set(part.names) else {}
        return {n: part[n] for n in names if n in part}
