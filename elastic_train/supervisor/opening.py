"""The next generation, planned from its candidates: who joins it, whether its loops go on in place
(and if not, which read of theirs made them re-enter), and where it resumes from. It reads the run's
records and changes nothing: the controller carries the plan out (controller.py `_open_generation`)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_train.config import ElasticConfig, ScalingConfig
from elastic_train.protocol import Position, ResumePlan
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.commits import Commits
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.supervisor.membership import GenerationPlan, WorkerRecord, plan_generation
from elastic_train.supervisor.roster import Roster


@dataclass(frozen=True)
class Opening:
    """The plan of generation `generation + 1`, made from `candidates`."""

    candidates: list[WorkerRecord]  # those the plan places (survivors alone when newcomers wait)
    plan: GenerationPlan
    chosen: list[WorkerRecord]  # its members, in rank order
    at: Position | None  # where their loops go on in place; None: the loop is re-entered
    why: str | None  # what in the survivors' loops made them re-enter, when that is why

    def resumed_from(self, resume: ResumePlan | None) -> str | None:
        """Which path the recovery took, for its event."""
        if self.at is not None:
            return "in place"
        if resume is None:
            return None
        return "storage" if resume.stored else "memory"


class Openings:
    def __init__(self, scaling: ScalingConfig, elastic: ElasticConfig, ledger: CheckpointLedger, roster: Roster,
                 commits: Commits):
        self._scaling, self._elastic, self._ledger, self._roster, self._commits = (scaling, elastic, ledger, roster,
                                                                                 commits)

    def going_on(self, candidates: list[WorkerRecord], generation: int) -> tuple[Position | None, str | None]:
        """Where `candidates` go on in place as the next generation (policy.in_place), or why they would
        not compute there what a re-entered loop computes (then None, and the reason: policy.unfaithful)."""
        at = policy.in_place([w.outcome.in_place if w.outcome is not None and w.is_member(generation) else None
                              for w in candidates], [w.rank for w in candidates])
        if at is None:
            return None, None
        placements = plan_generation(candidates, generation, self._scaling.max_workers, False,
                                     self.vacated(candidates, generation)).placements
        world = len(placements)
        places = [{"rank": p.rank, "world_size": world, "local_rank": p.local_rank,
                   "local_world_size": p.local_world_size, "node_rank": p.node_rank}
                  for p in (placements[w.worker_id] for w in candidates)]
        why = policy.unfaithful([w.outcome.reads for w in candidates], places)
        return (None, why) if why is not None else (at, None)

    def vacated(self, candidates: list[WorkerRecord], generation: int) -> dict[int, str]:
        """The ranks of `generation` whose members are not among `candidates`, and their nodes: a
        replacement there takes the rank (membership.assign_ranks)."""
        staying = {w.worker_id for w in candidates}
        return {w.rank: w.node_id for w in self._roster.members(generation) if w.worker_id not in staying}

    def newest_state(self, workers: list[WorkerRecord]) -> ResumePlan | None:
        """The newest state `workers` can resume from, in their memory or in storage."""
        return policy.resume_from(self._ledger.resume_plan({w.worker_id for w in workers}, self._roster.holds(),
                                                           alive=self._roster.live_ids()), self._commits.newest)

    def plan(self, candidates: list[WorkerRecord], generation: int) -> Opening:
        """The next generation after `generation`, from the workers parked for it."""
        survivors = [w for w in candidates if w.is_member(generation)]
        at, why = self.going_on(survivors, generation)
        if at is not None and len(survivors) < len(candidates):
            newest = self.newest_state(candidates)
            back = len(survivors) < self._scaling.min_workers <= len(candidates)
            if not policy.newcomers_join(at, newest.index if newest else None, back_at_size=back):
                candidates = survivors  # they go on in place; the newcomers join at a report with a checkpoint
        plan = plan_generation(candidates, generation, self._scaling.max_workers, self._elastic.replicate_checkpoints,
                               self.vacated(candidates, generation))
        records = {w.worker_id: w for w in candidates}
        chosen = [records[worker_id] for worker_id in plan.placements]
        at = self.going_on(chosen, generation)[0]
        why = why if at is None else None  # the survivors' loops hold what their new places change
        return Opening(candidates, plan, chosen, at, why)

    def resume(self, opening: Opening, generation: int) -> ResumePlan | None:
        """Where `opening` resumes from, once `generation`'s reports are closed: going on in place, the
        loops go on from their reports (nothing to load); else the newest state its members reach."""
        if opening.at is not None:
            return ResumePlan(index=opening.at.index, generation=generation)
        return self.newest_state(opening.chosen)
