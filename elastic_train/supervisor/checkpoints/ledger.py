"""The supervisor's record of reported checkpoints: what each rank reported, who holds it in
memory, what is stored, and which checkpoint a new generation resumes from.

Merge rule (as Ray Train's): a checkpoint is the union of the files its ranks reported, by name;
ranks reporting the same name report the same replicated content. So a checkpoint can be served
from memory as long as every name it holds is still held by some live worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_train.checkpoint.checkpoint import DICT_PART_NAMES, is_state_file, share_file, share_rank
from elastic_train.protocol import HeldCheckpoint, ResumePlan, WorkerInfo

PRUNE_AFTER = 64  # entries added since the last prune before the next one (keeps pruning O(1) per report)


@dataclass
class ReportEntry:
    generation: int
    world_size: int
    parts: dict[int, tuple[int, list[str]]] = field(default_factory=dict)  # rank -> (worker id, names)
    replicas: dict[int, list[str]] = field(default_factory=dict)  # worker id -> names it keeps for a peer
    reported_ranks: set[int] = field(default_factory=set)
    metrics: dict[str, Any] | None = None  # rank 0's: a committed checkpoint's manifest keeps them
    metrics_by_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    loader_states: list[dict[str, Any]] = field(default_factory=list)
    to_store: bool | None = None  # chosen by the store cadence when the first part is reported
    stored: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # worker id -> stored file facts
    committed: bool = False
    given_up: bool = False  # a part could not be stored: this index will never commit
    unwind: bool = False  # the group re-forms after this report (decided when the last rank reports it)
    made: bool = False  # every rank reported it, and the supervisor acted on that (once)
    counted: bool = False  # rank 0's metrics went into the run's metrics and history (once)
    dir_name: str | None = None  # the folder the report named (`checkpoint_dir_name`); None: ours
    stored_by_loop: bool = False  # the loop wrote the checkpoint into storage itself (NO_UPLOAD): nothing to upload
    stored_by_ranks: set[int] = field(default_factory=set)  # the ranks that reported it so; the lowest lists it
    # Made by every rank, though not every rank's report came: its barrier failed after its step, and a
    # survivor holds the state (unagreed); or its barrier passed (every report is sent after it) and a
    # rank died with its report on the way (closed when the generation ended).
    made_by_all: bool = False
    part_ranks: set[int] | None = None  # the ranks that reported a part, as the report's barrier agreed
    # worker id -> name -> {"size", "xxh3_128"} of the copy it holds, as made with the bytes (as they were
    # reported, or as a live part was serialized; told as it parks, or with a replica): a resume from
    # memory checks each file it is served against them.
    copies: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    corrupt: set[tuple[int, str]] = field(default_factory=set)  # (worker id, name): a copy found not as made
    restorers: set[int] = field(default_factory=set)  # holders a resume plan told to store it (`ResumePlan.store`)

    @property
    def complete(self) -> bool:
        """Every rank's report is here."""
        return len(self.reported_ranks) == self.world_size

    @property
    def whole(self) -> bool:
        """Its files are known: every rank reported, or it was made by all and every rank its barrier
        agreed held a part reported it (`part_ranks`), or any one dict part is the
        whole checkpoint (ranks that report the same name report the same content), or every rank's
        share of a sharded model's kept state is held (a rank's share is held, and copied to its
        buddy, as it is reported: one that died with its report on the way left its share behind)."""
        if self.complete:
            return True
        if self.made_by_all and self.part_ranks is not None and self.part_ranks <= set(self.parts):
            return True  # every part its barrier agreed on is here: the missing reports had none
        known = self.names.union(*self.replicas.values())
        return self.made_by_all and bool(self.parts) and (self.names <= DICT_PART_NAMES or self.shares <= known)

    @property
    def shares(self) -> set[str]:
        """Every rank's share file of a sharded model's kept state at this report's world size."""
        return {share_file(rank) for rank in range(self.world_size)}

    def served(self) -> set[str]:
        """The files a resume from this report reads: a kept state's (every rank's share of a sharded
        one), or the checkpoint's without the kept state reported beside it."""
        if not self.state_only:
            return {n for n in self.names if not is_state_file(n)}
        return self.shares if any(share_rank(n) is not None for n in self.names) else self.names

    @property
    def names(self) -> set[str]:
        return {n for _, names in self.parts.values() for n in names}

    @property
    def state_only(self) -> bool:
        """The state a run keeps live for recovery (`prepare_model(model, live_state=True)`): served
        from memory to the next generation, never stored. Whole on every rank, or each rank's share of a
        sharded model's."""
        names = self.names
        return bool(names) and all(map(is_state_file, names))

    @property
    def ready_to_commit(self) -> bool:
        stored = (self.stored_by_loop and bool(self.stored)) or (bool(self.parts) and self.names <= set(self.file_facts()))
        return self.whole and stored and not self.committed and not self.given_up

    @property
    def pending(self) -> bool:
        """Its checkpoint is still to be committed, or parts of it are stored and it never will be."""
        return not self.committed and ((bool(self.to_store) and not self.given_up) or bool(self.stored))

    def uploaders(self) -> set[int]:
        """The workers that store a part: every reporter, as in Ray Train, except of a dict checkpoint
        (one rank's part is all of it): its lowest-ranked reporter alone. So every rank reporting its
        live state (`Checkpoint.from_dict`) costs storage one upload, not one per rank. And the holders
        told to store it again (`restorers`): its folder is not removed under them."""
        if self.parts and self.names <= DICT_PART_NAMES:
            return {self.parts[min(self.parts)][0]} | self.restorers
        return {wid for wid, _ in self.parts.values()} | self.restorers

    def unstored(self) -> set[int]:
        """The workers told to store a part of this checkpoint that have not reported it stored."""
        return self.uploaders() - set(self.stored) if self.to_store else set()

    def uploader_lost(self, live_workers: set[int]) -> bool:
        """Is a worker told to store a part of it gone without telling it stored? Its part may be in
        storage all the same: the notice follows the upload in the report stream (worker/store/worker_store.py)
        and may have died with it. Only a copy held in memory can make the checkpoint whole again."""
        return bool(self.unstored() - live_workers)

    def left_to_holders(self, live_workers: set[int]) -> bool:
        """Is it for the workers holding it in memory to store: an uploader was lost before it told its
        part stored, and the checkpoint is neither given up nor committed?"""
        return self.uploader_lost(live_workers) and not self.given_up and not self.committed

    def holders(self, name: str) -> list[int]:
        """The workers that hold file `name` in memory (a copy found corrupt aside): its reporters, by
        rank, then replica keepers."""
        found = ([wid for _, (wid, names) in sorted(self.parts.items()) if name in names]
                 + [wid for wid, names in sorted(self.replicas.items()) if name in names])
        return [wid for wid in found if (wid, name) not in self.corrupt]

    def note_copies(self, worker_id: int, facts: dict[str, dict[str, Any]]) -> None:
        """The facts of the files `worker_id` holds; those first known are kept (a copy's facts never
        change: they were made with its bytes)."""
        if facts:
            self.copies[worker_id] = {**facts, **self.copies.get(worker_id, {})}

    def file_facts(self) -> dict[str, dict[str, Any]]:
        """Size and checksum of every stored file, merged over the workers that stored them by name."""
        merged: dict[str, dict[str, Any]] = {}
        for facts in self.stored.values():
            merged.update(facts)
        return merged


class CheckpointLedger:
    def __init__(self, keep: int):
        self._keep = keep  # checkpoints each worker holds in memory
        self.entries: dict[int, ReportEntry] = {}
        self._prune_at = PRUNE_AFTER

    def prune(self) -> None:
        """Forget the reports no decision needs any more; called after each made report, it works once
        the ledger doubled since its last pass. Without it a run of a million reports would keep a
        million entries, each with every rank's metrics, and each commit would scan them all. Kept: a
        report not yet made; a checkpoint awaited in storage, or stored in part and not committed
        (`abandoned_before` removes its folder); the newest 2 x `keep` + 1 checkpoints (a resume may
        still be served from memory)."""
        if len(self.entries) < self._prune_at:
            return
        recent = set(sorted((i for i, e in self.entries.items() if e.parts), reverse=True)[: 2 * self._keep + 1])
        for i in [i for i, e in self.entries.items() if e.made and i not in recent and not e.pending]:
            del self.entries[i]
        self._prune_at = 2 * len(self.entries) + PRUNE_AFTER

    def record(
        self,
        generation: int,
        world_size: int,
        index: int,
        rank: int,
        worker_id: int,
        names: list[str] | None,
        metrics: dict[str, Any],
        loader_states: list[dict[str, Any]],
    ) -> ReportEntry:
        entry = self.entries.setdefault(index, ReportEntry(generation, world_size))
        entry.reported_ranks.add(rank)
        entry.metrics_by_rank[rank] = metrics
        if names is not None:
            entry.parts[rank] = (worker_id, names)
        if rank == 0:
            entry.metrics = metrics
        if rank == 0 or not entry.loader_states:  # global positions, alike on every rank: any rank's serve
            entry.loader_states = loader_states
        return entry

    def record_unagreed(self, generation: int, world_size: int, index: int, rank: int, worker_id: int,
                        names: list[str], metrics: dict[str, Any],
                        loader_states: list[dict[str, Any]]) -> ReportEntry:
        """A survivor of `generation` holds the live dict part of report `index`, whose barrier failed
        after its step made a collective with every peer (worker/report/lockstep.py `_keep_unagreed`). A dict
        part is the whole checkpoint (ranks that report the same name report the same content), so
        the report counts as made: the next generation may resume from it."""
        entry = self.record(generation, world_size, index, rank, worker_id, names, metrics, loader_states)
        entry.made_by_all = True
        return entry

    def close(self, generation: int) -> list[tuple[int, ReportEntry]]:
        """`generation` ended: its reports that some rank's report is missing from were made by every
        rank all the same (each is sent after its barrier passed; the missing one died with its sender).
        Returns them, by index, for the caller to count as made."""
        closed = sorted(((i, e) for i, e in self.entries.items()
                         if e.generation == generation and e.reported_ranks and not e.complete and not e.made),
                        key=lambda item: item[0])
        for _, entry in closed:
            entry.made_by_all = True
        return closed

    def record_replica(self, generation: int, index: int, worker_id: int, names: list[str],
                       world_size: int | None = None, facts: dict[str, dict[str, Any]] | None = None) -> None:
        """A worker keeps a copy of a peer's part (`facts`: as the peer reported them). For the running
        generation (its `world_size` given) it may say so before the report itself is recorded: the
        entry is opened then."""
        entry = self.entries.get(index)
        if entry is None and world_size is not None:
            entry = self.entries[index] = ReportEntry(generation, world_size)
        if entry is not None and entry.generation == generation:
            entry.replicas[worker_id] = sorted(set(entry.replicas.get(worker_id, [])) | set(names))
            entry.note_copies(worker_id, facts or {})

    def note_held(self, worker_id: int, held: list[HeldCheckpoint]) -> None:
        """What a parking worker holds, with its files' facts (a live part's are made as it is serialized,
        after its report)."""
        for h in held:
            entry = self.entries.get(h.index)
            if entry is not None and entry.generation == h.generation:
                entry.note_copies(worker_id, h.facts)

    def mark_corrupt(self, generation: int, index: int, worker_id: int, name: str) -> bool:
        """`worker_id`'s copy of file `name` of checkpoint `index` of `generation` was served and found
        not to be what its report made: no resume is planned from it again. False if already known
        (or the checkpoint is forgotten)."""
        entry = self.entries.get(index)
        if entry is None or entry.generation != generation or (worker_id, name) in entry.corrupt:
            return False
        entry.corrupt.add((worker_id, name))
        return True

    def adopt(self, generation: int, world_size: int, members: list[WorkerInfo]) -> None:
        """Rebuild the entries of `generation` from what its members hold in memory (a restarted
        supervisor). Every member started the generation at the same index and reports in lockstep,
        so one that reached index `i` has reported `i`."""
        for m in members:
            for held in m.held:
                if held.generation == generation:
                    entry = self.entries.setdefault(held.index, ReportEntry(generation, world_size))
                    entry.parts[held.rank] = (m.worker_id, held.names)
                    entry.note_copies(m.worker_id, held.facts)
                    entry.loader_states = held.loader_states  # global positions: alike on every rank
        for index, entry in self.entries.items():
            entry.reported_ranks.update(m.rank for m in members if m.index >= index)

    def mark_stored(
        self, index: int, worker_id: int, facts: dict[str, dict[str, Any]], generation: int
    ) -> ReportEntry | None:
        """Note that `worker_id` stored its part of checkpoint `index` of `generation`; returns the
        entry, if still known. A part of another generation is not counted: after a rewind the next
        generation reports the same index again, and an older part would make its entry look stored."""
        entry = self.entries.get(index)
        if entry is None or entry.generation != generation:
            return None
        entry.stored[worker_id] = facts
        return entry

    def abandoned_before(self, index: int, live_workers: set[int]) -> list[tuple[int, int, str | None]]:
        """Older checkpoints that stored some parts but will never commit (a newer one has): their
        folders are torn. Each is marked given up at once, and returned once, as (index,
        generation, folder name), when no live worker may still be uploading a part of it (one told to store its
        part that has not reported it stored): removing a folder under a writer would only leave it
        to be recreated. Those are returned by a later call, or swept when the run ends. A folder the
        report named is not returned while another entry names it too (it is being written again)."""
        names = {e.dir_name for i, e in self.entries.items() if i >= index and e.dir_name}
        found = []
        for i, e in self.entries.items():
            if i >= index or e.committed or not e.stored:
                continue
            e.given_up = True
            if e.unstored() & live_workers:
                continue
            e.stored.clear()
            if e.dir_name not in names:
                found.append((i, e.generation, e.dir_name))
        return sorted(found)

    def resume_plan(self, live_workers: set[int],
                    holds: Mapping[int, set[tuple[int, int, str]]] | None = None,
                    alive: set[int] | None = None) -> ResumePlan | None:
        """The newest checkpoint that live workers can serve whole from memory. `holds` has what a
        parked worker told it holds, as (generation, index, file): exact, where the ledger's own view of
        what each worker still keeps in memory is not (a worker evicts its oldest snapshots, its own
        and its peers' apart). `alive`: every worker alive, those that do not serve included (default:
        `live_workers`); an uploader among them may still tell its part stored."""
        holds, alive = holds or {}, live_workers if alive is None else alive
        with_parts = sorted((i for i, e in self.entries.items() if e.whole and e.parts), reverse=True)
        for index in with_parts:
            entry = self.entries[index]

            def serves(wid: int, name: str) -> bool:
                return wid in live_workers and (wid not in holds or (entry.generation, index, name) in holds[wid])

            holders: dict[int, list[str]] = {}
            facts: dict[str, dict[str, Any]] = {}
            # A kept state is served alone; beside a checkpoint (a barrier failed as ranks reported both), never.
            for name in sorted(entry.served()):
                holder = next((wid for wid in entry.holders(name) if serves(wid, name)), None)
                if holder is None:
                    break
                holders.setdefault(holder, []).append(name)
                if name in entry.copies.get(holder, {}):
                    facts[name] = entry.copies[holder][name]
            else:
                # Its holders store it: a barrier failed before any rank stored it, or an uploader was lost
                # before it told its part stored (it may have died with the notice).
                store = (entry.made_by_all and bool(entry.to_store) and not entry.stored and not entry.committed
                         ) or entry.left_to_holders(alive)
                return ResumePlan(index=index, holders=holders, loader_states=entry.loader_states,
                                  generation=entry.generation, store=store, dir_name=entry.dir_name,
                                  state_only=entry.state_only, facts=facts)
        return None

    def restoring(self, plan: ResumePlan) -> None:
        """A new generation resumes from `plan`, whose holders store it (`plan.store`): they count as
        its uploaders until they tell it stored again (what one stored before is written anew), so
        its folder is not removed under them."""
        entry = self.entries.get(plan.index)
        if plan.store and entry is not None and entry.generation == plan.generation:
            entry.restorers |= set(plan.holders)
            for worker_id in plan.holders:
                entry.stored.pop(worker_id, None)

    def rewind(self, index: int) -> None:
        """Forget reports after `index`: the new generation redoes those steps."""
        for i in [i for i in self.entries if i > index]:
            del self.entries[i]
        for i in sorted(self.entries)[: -2 * self._keep - 1]:
            if self.entries[i].committed or not self.entries[i].parts:
                del self.entries[i]
