"""Who the workers are, which generation each belongs to, and how ranks are assigned."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping

from elastic_train.protocol import Assignment, Exit, Outcome, ResumePlan


class WorkerStatus(str, enum.Enum):
    PENDING = "PENDING"  # the actor is requested; Ray has not placed it yet
    STARTING = "STARTING"  # placed and constructed; not yet ready
    PARKED = "PARKED"  # ready, waiting at the supervisor for a place in a generation
    TRAINING = "TRAINING"  # a member running the loop in the current generation
    LOST = "LOST"  # dead, or dropped and fenced out


class LostCause(str, enum.Enum):
    """Why a worker left the run: a fixed set, for the event log and the `workers_lost` metric."""

    DIED = "died"  # its process or actor ended (Ray told us)
    SILENT = "silent"  # no heartbeat for heartbeat_timeout_s: its machine hung or was cut off
    HUNG = "hung"  # heartbeats, but no report for progress_timeout_s while its peers were ahead
    COLLECTIVE_FAILURE = "collective_failure"  # a collective failed and it did not answer the liveness probe
    FENCED = "fenced"  # it did not leave an ended generation within drain_timeout_s: dropped and fenced out
    PREEMPTED = "preempted"  # it left under a preemption notice (its part of the checkpoint handed over)


@dataclass
class WorkerRecord:
    worker_id: int
    actor: Any
    status: WorkerStatus = WorkerStatus.PENDING
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    last_heartbeat: float = 0.0
    generation: int = -1
    rank: int = -1
    store_port: int = 0  # of the store it serves as it parks (worker/group/rendezvous.py)
    outcome: Outcome | None = None
    lost_reason: str = ""
    facts: dict[str, float] = field(default_factory=dict)
    waiting: asyncio.Future | None = None  # resolved with the worker's next Assignment or Stop
    holds: set[tuple[int, int, str]] = field(default_factory=set)  # (generation, index, file) held, told at parking
    last_report: tuple[int, float] = (0, 0.0)  # (index, monotonic time) of its last report in its generation
    leaving: bool = False  # its machine is about to go (a preemption notice): no new generation takes it
    slot: int = 0  # which of the run's `max` places it fills: its label selector (placement.py); -1: a warm spare
    planned_node: str = ""  # the node PACK asked for, until it runs (then `node_id`)
    bundle: Any = None  # the placement group reserved for its place (supervisor/bundles.py), kept past its process

    def is_member(self, generation: int) -> bool:
        """Has it a rank in `generation`?"""
        return self.generation == generation and self.rank >= 0

    @property
    def exited(self) -> Exit | None:
        """How this worker left the current generation, if it did."""
        return self.outcome.exit if self.status is WorkerStatus.PARKED and self.outcome else None


@dataclass
class Placement:
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int


def assign_ranks(survivors: list[WorkerRecord], newcomers: list[WorkerRecord],
                 vacated: Mapping[int, str] | None = None) -> dict[int, Placement]:
    """Ranks for a new generation. Survivors keep their numbers where they all fit the new world, the
    newcomers filling the ranks of those gone (each that of a worker gone from its own node, where
    `vacated`, rank to node, names one): a replacement takes the lost rank's place, and no survivor's
    changes. Else survivors keep their order (rank 0 stays rank 0) and newcomers follow, by id."""
    kept = sorted(survivors, key=lambda w: w.rank)
    pool = sorted(newcomers, key=lambda w: w.worker_id)
    size = len(kept) + len(pool)
    if all(w.rank < size for w in kept):
        by_rank: dict[int, WorkerRecord] = {w.rank: w for w in kept}
        for rank in (r for r in range(size) if r not in by_rank):
            node = (vacated or {}).get(rank)
            by_rank[rank] = pick = next((w for w in pool if w.node_id == node), pool[0])
            pool.remove(pick)
        ordered = [by_rank[rank] for rank in range(size)]
    else:
        ordered = kept + pool
    nodes: list[str] = []
    for w in ordered:
        if w.node_id not in nodes:
            nodes.append(w.node_id)
    per_node = {n: [w for w in ordered if w.node_id == n] for n in nodes}
    return {
        w.worker_id: Placement(
            rank=rank,
            local_rank=per_node[w.node_id].index(w),
            local_world_size=len(per_node[w.node_id]),
            node_rank=nodes.index(w.node_id),
        )
        for rank, w in enumerate(ordered)
    }


@dataclass(frozen=True)
class GenerationPlan:
    """Who is in the next generation and where: each member's placement by worker id (in rank
    order), rank 0's worker (it serves the rendezvous), and each member's buddy, the next rank, which
    keeps a copy of its checkpoint parts (none when not replicating, or alone)."""

    placements: dict[int, Placement]
    master: int
    buddies: dict[int, int]


def plan_generation(candidates: list[WorkerRecord], generation: int, max_workers: int, replicate: bool,
                    vacated: Mapping[int, str] | None = None) -> GenerationPlan:
    """The next generation of `candidates` (the parked workers ready to join, after `generation`):
    its survivors, then newcomers, those on a node a member of `generation` left first (`vacated`:
    its rank to its node), then by worker id, at most `max_workers` in all; ranks by `assign_ranks`."""
    survivors = [w for w in candidates if w.is_member(generation)]
    kept = {w.worker_id for w in survivors}
    left_nodes = set((vacated or {}).values())
    newcomers = sorted((w for w in candidates if w.worker_id not in kept),
                       key=lambda w: (w.node_id not in left_nodes, w.worker_id))
    chosen = (sorted(survivors, key=lambda w: w.rank) + newcomers)[:max_workers]
    placements = assign_ranks([w for w in chosen if w.worker_id in kept], [w for w in chosen if w.worker_id not in kept],
                              vacated)
    by_rank = {placement.rank: worker_id for worker_id, placement in placements.items()}
    buddies = ({worker_id: by_rank[(placement.rank + 1) % len(chosen)] for worker_id, placement in placements.items()}
               if replicate and len(chosen) > 1 else {})
    return GenerationPlan(placements, by_rank[0], buddies)


def assignments(plan: GenerationPlan, candidates: list[WorkerRecord], generation: int, resume: ResumePlan | None,
                max_workers: int, previous_ranks: tuple[int, ...] | None = None) -> dict[int, Assignment]:
    """Each member's place in generation `generation` of `plan`, resuming from `resume` (or going on in
    place: `previous_ranks`, the members' ranks in the previous generation, in the plan's order)."""
    records = {w.worker_id: w for w in candidates}
    master = records[plan.master]
    peers = {worker_id: records[worker_id].actor for worker_id in plan.placements}
    return {worker_id: Assignment(
        generation=generation, rank=p.rank, world_size=len(plan.placements), local_rank=p.local_rank,
        local_world_size=p.local_world_size, node_rank=p.node_rank, master_addr=master.ip,
        master_port=master.store_port, resume=resume, peers=peers,
        buddy=records[plan.buddies[worker_id]].actor if worker_id in plan.buddies else None,
        max_world_size=max_workers, previous_ranks=previous_ranks) for worker_id, p in plan.placements.items()}


def raised(members: list[WorkerRecord]) -> dict[int, BaseException]:
    """What the user's code raised on each rank of `members` (a rank that raised after the
    generation ended, its peers' error having ended it, is one too)."""
    return {m.rank: m.outcome.raised() for m in members if m.outcome is not None and m.outcome.error is not None}


def returned(members: list[WorkerRecord]) -> bytes | None:
    """What rank 0's loop returned, if it returned."""
    return next((m.outcome.returned for m in members
                 if m.rank == 0 and m.outcome is not None and m.outcome.exit is Exit.FINISHED), None)
