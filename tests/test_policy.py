"""The supervisor's pure decisions, over the combinations the Ray tests sample (no Ray here)."""

from __future__ import annotations

import pytest

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.manifest import Manifest
from elastic_train.config import ElasticConfig, FailureConfig, ScalingConfig
from elastic_train.protocol import Exit, Position, ResumePlan
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger, ReportEntry
from elastic_train.supervisor.membership import WorkerRecord, assignments, plan_generation
from elastic_train.supervisor.policy import Decision, Do, Member, LastReport, Stall, stalled
from elastic_train.supervisor.watch.goodput import GoodputAccount
from elastic_train.supervisor.watch.pace import PaceWatch, climbing, slow_ranks


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "progress, now, timeout, expected",
    [
        # The watchdog is off, or someone reported within the timeout: nothing to do.
        ([LastReport(0, 5, 0.0), LastReport(1, 4, 0.0)], 100.0, None, Stall()),
        ([LastReport(0, 5, 99.0), LastReport(1, 4, 0.0)], 100.0, 3.0, Stall()),
        ([], 100.0, 3.0, Stall()),
        # Stalled: the rank behind the others is hung (a loop without a collective; others wait at report).
        ([LastReport(0, 5, 90.0), LastReport(1, 4, 80.0)], 100.0, 3.0, Stall(hung=(1,))),
        ([LastReport(0, 5, 90.0), LastReport(1, 4, 80.0), LastReport(2, 4, 80.0), LastReport(3, 5, 90.0)], 100.0, 3.0,
         Stall(hung=(1, 2))),
        # Stalled with every rank at the same report (all stuck in one collective): abort the generation.
        ([LastReport(0, 5, 90.0), LastReport(1, 5, 90.0)], 100.0, 3.0, Stall(restart=True)),
        ([LastReport(0, 0, 50.0)], 100.0, 3.0, Stall(restart=True)),
        # Exactly at the timeout is not yet a stall.
        ([LastReport(0, 5, 97.0), LastReport(1, 4, 0.0)], 100.0, 3.0, Stall()),
    ],
)
def test_stalled_generation(progress, now, timeout, expected):
    assert stalled(progress, now, timeout) == expected


# -- what a generation's state means (policy.running / restarting / scheduling) -------------------

FIXED_2, ELASTIC_1_2 = ScalingConfig(num_workers=2), ScalingConfig(num_workers=(1, 2))
NO_LOSS_COUNT, LOSS_COUNTS = FailureConfig(max_failures=3), FailureConfig(max_failures=3, count_worker_loss=True)


def _running(members, resizing=False, standby=0, scaling=FIXED_2, failure=NO_LOSS_COUNT, counted=False,
             in_place=False):
    return policy.running(members, resizing=resizing, standby=standby, scaling=scaling, failure=failure,
                          error_counted=counted, in_place=in_place)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scaling", [FIXED_2, ELASTIC_1_2])
def test_a_user_error_on_every_rank_is_one_failure(scaling):
    members = [Member(0, 0, Exit.USER_ERROR, detail="rank 0 trace"), Member(1, 1, Exit.USER_ERROR, detail="rank 1")]
    assert _running(members, scaling=scaling) == Decision(Do.RESTART, "user code raised", failure="rank 0 trace")
    # The second rank's error, seen after the first was counted, is not counted again.
    assert _running(members, scaling=scaling, counted=True).failure is None
    after = policy.restarting(members, parked=2, waited_s=0.1, drain_timeout_s=30, scaling=scaling,
                              error_counted=True)
    assert after == Decision(Do.OPEN)


@pytest.mark.timeout(10)
def test_a_user_error_on_one_rank_while_the_other_still_runs():
    members = [Member(0, 0), Member(1, 1, Exit.USER_ERROR, detail="boom")]
    assert _running(members) == Decision(Do.RESTART, "user code raised", failure="boom")
    # The other rank is aborted; until it leaves, the restart waits.
    assert policy.restarting(members, parked=1, waited_s=1, drain_timeout_s=30, scaling=FIXED_2,
                             error_counted=True) == Decision(Do.WAIT)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lost_rank", [0, 1])  # the rank that checkpoints, or another
@pytest.mark.parametrize("scaling, after_restart", [(FIXED_2, Do.SCHEDULE), (ELASTIC_1_2, Do.OPEN)])
def test_a_lost_member_restarts_the_generation(lost_rank, scaling, after_restart):
    members = [Member(r, r, lost=r == lost_rank, detail="actor died") for r in (0, 1)]
    assert _running(members, scaling=scaling) == Decision(Do.RESTART, "worker lost")
    assert _running(members, scaling=scaling, failure=LOSS_COUNTS).failure == f"worker {lost_rank} lost: actor died"
    # The survivor left; a fixed-size run waits for the replacement, an elastic one goes on at 1.
    survivor = [Member(r, r, lost=r == lost_rank, exit=None if r == lost_rank else Exit.UNWOUND) for r in (0, 1)]
    decision = policy.restarting(survivor, parked=1, waited_s=0.2, drain_timeout_s=30, scaling=scaling,
                                 error_counted=False)
    assert decision.do is after_restart and decision.failure is None


@pytest.mark.timeout(10)
def test_a_member_that_does_not_leave_an_ended_generation_is_dropped():
    members = [Member(0, 0, Exit.UNWOUND), Member(1, 1)]  # rank 1 hangs, even when aborted
    assert policy.restarting(members, parked=1, waited_s=29, drain_timeout_s=30, scaling=ELASTIC_1_2,
                             error_counted=False) == Decision(Do.WAIT)
    decision = policy.restarting(members, parked=1, waited_s=31, drain_timeout_s=30, scaling=ELASTIC_1_2,
                                 error_counted=False)
    assert decision.dropped == (1,) and decision.do is Do.OPEN and "drain_timeout_s" in decision.reason


@pytest.mark.timeout(10)
@pytest.mark.parametrize("notified", [0, 1])
@pytest.mark.parametrize("scaling, standby, expected", [
    (FIXED_2, 0, Do.SCHEDULE),  # the replacement is not ready yet: wait for it
    (FIXED_2, 1, Do.OPEN),  # it is: re-form at 2 with it
    (ELASTIC_1_2, 0, Do.OPEN),  # go on at 1
])
def test_a_preemption_notice_re_forms_the_group_without_the_leaving_worker(notified, scaling, standby, expected):
    running_ = [Member(r, r, leaving=r == notified) for r in (0, 1)]
    assert _running(running_, resizing=True, scaling=scaling) == Decision(Do.WAIT)
    half = [Member(r, r, Exit.UNWOUND if r == 0 else None, leaving=r == notified) for r in (0, 1)]
    assert _running(half, resizing=True, scaling=scaling) == Decision(Do.WAIT)
    unwound = [Member(r, r, Exit.UNWOUND, leaving=r == notified) for r in (0, 1)]
    assert _running(unwound, resizing=True, standby=standby, scaling=scaling).do is expected


@pytest.mark.timeout(10)
def test_finishing_growing_and_collective_failures():
    assert _running([Member(0, 0, Exit.FINISHED), Member(1, 1, Exit.FINISHED)]).do is Do.FINISH
    assert _running([Member(0, 0, Exit.FINISHED), Member(1, 1, lost=True)]).do is Do.FINISH
    assert _running([Member(0, 0, Exit.FINISHED), Member(1, 1)]) == Decision(Do.WAIT)
    assert _running([Member(0, 0, Exit.COLLECTIVE_ERROR), Member(1, 1)]) == Decision(Do.RESTART, "collective failed")
    assert _running([Member(0, 0)], standby=1, scaling=ELASTIC_1_2).do is Do.RESIZE
    assert _running([Member(0, 0), Member(1, 1)], standby=1) == Decision(Do.WAIT)  # already at max


@pytest.mark.timeout(10)
def test_a_fixed_size_run_below_its_size_is_back_at_it_as_soon_as_its_replacement_is_ready():
    """Its survivors went on at N - 1; the replacement parked: every loop re-enters at N now (from
    the newest checkpoint in memory), not at the next report carrying a checkpoint."""
    assert _running([Member(0, 0)], standby=1) == Decision(Do.RESTART, "1 replacement(s) ready: back at 2 workers")
    assert _running([Member(0, 0)], standby=0) == Decision(Do.WAIT)
    mid_step = Position(7, 1)
    assert not policy.newcomers_join(mid_step, 5)  # they would make the survivors redo steps 6 and 7
    assert policy.newcomers_join(mid_step, 5, back_at_size=True)  # ... as Ray's restart at full size does


@pytest.mark.timeout(10)
def test_scheduling_opens_when_enough_workers_are_ready_or_fails_clearly():
    elastic = ElasticConfig(min_workers_timeout_s=60, initial_placement_timeout_s=30)
    kw = {"scaling": FIXED_2, "elastic": elastic, "first": False, "expected_initial": 2}
    assert policy.scheduling(parked=2, starting=0, waited_s=0, **kw).do is Do.OPEN
    assert policy.scheduling(parked=1, starting=1, waited_s=10, **kw).do is Do.WAIT
    failed = policy.scheduling(parked=1, starting=0, waited_s=61, **kw)
    assert failed.do is Do.FAIL and "only 1 of the minimum 2 workers" in failed.reason
    assert "min_workers_timeout_s" in failed.reason


# -- where a new generation resumes, per checkpoint pattern (CheckpointLedger) ---------------------
def _ledger_after(pattern: str, world: int, reports: int, replicas: bool) -> CheckpointLedger:
    """A ledger that saw `reports` lockstep reports of `world` ranks checkpointing as `pattern` does."""
    ledger = CheckpointLedger(keep=2)
    for index in range(1, reports + 1):
        for rank in range(world):
            names = {"rank0": ["model.pt"] if rank == 0 else None, "same_name": ["step.txt"],
                     "own_shard": [f"shard_{rank}.pt"], "none": None, "every_rank_dict": ["dict_checkpoint.pt"]}[pattern]
            ledger.record(0, world, index, rank, rank, names, {"step": index} if rank == 0 else None, [])
            if replicas and names:
                ledger.record_replica(0, index, (rank + 1) % world, names)
    return ledger


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pattern", ["rank0", "same_name", "own_shard", "none"])
@pytest.mark.parametrize("lost_rank", [0, 1])
@pytest.mark.parametrize("replicas", [True, False])
def test_the_resume_point_for_each_checkpoint_pattern_and_lost_rank(pattern, lost_rank, replicas):
    ledger = _ledger_after(pattern, world=2, reports=5, replicas=replicas)
    plan = ledger.resume_plan({1 - lost_rank})
    if pattern == "none":
        assert plan is None  # nothing to resume from: the loop starts over, as with Ray Train
        return
    # Served from memory unless the lost rank held a file nobody else holds.
    only_the_lost_held_it = not replicas and (pattern == "own_shard" or (pattern == "rank0" and lost_rank == 0))
    if only_the_lost_held_it:
        assert plan is None
    else:
        assert plan is not None and plan.index == 5 and set(plan.holders) == {1 - lost_rank}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pattern, uploading_ranks", [("rank0", {0}), ("same_name", {0, 1, 2}), ("own_shard", {0, 1, 2}),
                                                       ("none", set()), ("every_rank_dict", {0})])
def test_who_uploads_a_stored_checkpoint(pattern, uploading_ranks):
    """Every rank that reported a part uploads it (as in Ray Train), except of a dict checkpoint every
    rank reported: one rank's part is all of it, so rank 0 alone uploads and the others are not waited for."""
    ledger = _ledger_after(pattern, world=3, reports=1, replicas=False)
    entry = ledger.entries[1]
    entry.to_store = bool(entry.parts)
    assert entry.uploaders() == uploading_ranks  # worker id = rank here
    assert entry.unstored() == uploading_ranks
    for rank in uploading_ranks:
        ledger.mark_stored(1, rank, {name: {"size": 1} for name in entry.parts[rank][1]}, 0)
    assert entry.unstored() == set() and entry.ready_to_commit == bool(uploading_ranks)


@pytest.mark.timeout(10)
def test_a_long_run_keeps_a_small_ledger_and_what_resumes_and_storage_still_need():
    """100,000 lockstep reports of 2 ranks: a metrics-only report every step, a live dict part on every
    rank every 10th, every 100th stored. The ledger stays a few entries long; the newest checkpoints
    (a resume's candidates), a checkpoint whose upload is still on its way, and a partly stored one
    that never committed are kept."""
    ledger = CheckpointLedger(keep=2)
    for index in range(1, 100_001):
        names = ["dict_checkpoint.pt"] if index % 10 == 0 else None
        for rank in range(2):
            entry = ledger.record(0, 2, index, rank, rank, names, {"step": index}, [])
        entry.to_store = True if index % 100 == 0 else None
        if index == 50_000:
            entry.stored = {0: {"dict_checkpoint.pt": {"size": 1}}}  # rank 1's part never stored
            entry.given_up = True
        elif index % 100 == 0 and index != 99_900:  # 99_900: its upload is still on its way
            entry.committed = True
        entry.made = True
        ledger.prune()
    assert len(ledger.entries) < 200, len(ledger.entries)
    assert {50_000, 99_900} <= set(ledger.entries)
    assert [i for i in sorted(ledger.entries) if ledger.entries[i].parts][-5:] == [99_960, 99_970, 99_980, 99_990,
                                                                                   100_000]
    assert ledger.resume_plan({1}).index == 100_000
    assert ledger.abandoned_before(100_000, set()) == [(50_000, 0, None)]


# == stragglers and growing memory (supervisor/watch/pace.py) =============================================
@pytest.mark.timeout(10)
def test_a_rank_is_slow_against_the_median_of_its_peers():
    assert slow_ranks({0: 0.1, 1: 0.35}, 2.0, 0.05) == {1}  # two ranks: against the other one
    assert slow_ranks({0: 0.1, 1: 0.11, 2: 0.1, 3: 0.5}, 2.0, 0.05) == {3}
    assert slow_ranks({0: 0.001, 1: 0.004}, 2.0, 0.05) == set()  # 4x, but 3 ms: noise
    assert slow_ranks({0: 5.0}, 2.0, 0.05) == set()  # alone: no peer to be slower than
    assert slow_ranks({0: 0.2, 1: 0.2}, 2.0, 0.05) == set()


@pytest.mark.timeout(10)
def test_a_straggler_is_flagged_after_its_streak_and_cleared_when_it_catches_up():
    watch = PaceWatch(factor=2.0, reports=3, min_excess_s=0.05, memory_reports=3, memory_min_growth_bytes=100)
    slow, fast = {0: 0.1, 1: 0.4}, {0: 0.1, 1: 0.1}
    assert [watch.observe(slow, {})[0] for _ in range(3)] == [set(), set(), {1}]
    assert watch.observe(slow, {}) == (set(), set(), set())  # flagged once
    assert watch.observe(fast, {}) == (set(), {1}, set()) and watch.stragglers == set()
    assert [watch.observe(slow, {})[0] for _ in range(2)] + [watch.observe(fast, {})[0]] == [set()] * 3  # streak broken
    watch.observe(slow, {})
    watch.observe({0: 0.1}, {})  # worker 1 left the run: no longer watched
    assert watch.streaks == {0: 0}


@pytest.mark.timeout(10)
def test_memory_is_growing_when_it_rose_at_every_report_by_enough():
    assert climbing([1, 2, 3, 400], 3, 100) and not climbing([1, 2, 3], 3, 0)
    assert not climbing([1, 500, 400, 900], 3, 100)  # fell once
    assert not climbing([1, 2, 3, 4], 3, 100)  # rose, but by little
    watch = PaceWatch(factor=2.0, reports=3, min_excess_s=0.05, memory_reports=2, memory_min_growth_bytes=100)
    flagged = [watch.observe({7: 0.1}, {7: rss})[2] for rss in (100, 200, 300, 400, 350, 500, 700)]
    assert flagged == [set(), set(), {7}, set(), set(), set(), {7}]


# == where the run's time went (supervisor/watch/goodput.py) ==============================================
@pytest.mark.timeout(10)
def test_goodput_counts_the_steps_kept_and_recovery_runs_from_the_fault_to_the_next_report():
    account = GoodputAccount(rate_window=3)
    assert account.opened(0, 0, now=10.0) == 0 and account.goodput(10.0) == 0.0
    for index in range(1, 5):
        assert account.made(index, [0.5, 0.7, 0.5], now=10.0 + index) is None  # the median counts: 0.5
    assert account.steps_per_s() == pytest.approx(1.0)  # over the last 3 reports
    assert account.goodput(14.0) == pytest.approx(4 * 0.5 / 4)
    account.lost(0, -1, now=14.2)  # a standby: no step lost, no recovery
    account.lost(-7, 1, now=14.3)  # a member of an older generation: not this one's fault
    assert account.fault_at is None
    account.lost(0, 1, now=14.5)
    account.fault(14.6)  # the failure that follows belongs to the same fault
    assert account.opened(1, 2, now=15.0) == 2  # resumed after report 2: reports 3 and 4 are made again
    assert account.steps_redone == 2 and sorted(account.kept) == [1, 2] and account.steps_per_s() == 0.0
    assert account.made(3, [0.5], now=16.0) == pytest.approx(1.5)  # the fault -> the next report made
    assert account.made(4, [0.5], now=16.5) is None
    assert account.goodput(18.0) == pytest.approx(4 * 0.5 / 8)
    assert account.opened(2, 0, now=19.0) == 4  # resumed from the start: nothing made counts any more
    assert account.kept == {} and account.steps_redone == 6


# -- checkpoints: where a generation resumes, what is stored as the run ends ---------------------
def _stored(index: int) -> CommittedCheckpoint:
    return CommittedCheckpoint(index, f"/run/checkpoint_{index}", Manifest(index, 0, 1, {}, loader_states=[{"at": index}]))


@pytest.mark.timeout(10)
def test_a_generation_resumes_from_memory_unless_storage_holds_a_newer_checkpoint():
    memory = ResumePlan(7, {10: ["model.pt"]}, generation=1)
    assert policy.resume_from(memory, None) is memory
    assert policy.resume_from(memory, _stored(7)) is memory  # as new: memory is faster
    from_storage = policy.resume_from(memory, _stored(9))
    assert (from_storage.index, from_storage.stored.index, from_storage.loader_states) == (9, 9, [{"at": 9}])
    assert policy.resume_from(None, _stored(3)).stored.index == 3 and policy.resume_from(None, None) is None


def _entry(**fields) -> ReportEntry:
    entry = ReportEntry(generation=2, world_size=2, parts={0: (10, ["shard_0"]), 1: (11, ["shard_1"])})
    for name, value in fields.items():
        setattr(entry, name, value)
    return entry


@pytest.mark.timeout(10)
@pytest.mark.parametrize("entry, generation, live, replaceable, expected", [
    (_entry(to_store=True), 2, {10, 11}, False, False),  # both uploaders alive: it may still commit
    (None, 2, {10, 11}, False, True),  # its generation rewound past it
    (_entry(to_store=True), 1, {10, 11}, False, True),  # another generation's report of that index
    (_entry(to_store=True, given_up=True), 2, {10, 11}, False, True),  # a part given up
    (_entry(to_store=True), 2, {10}, False, True),  # worker 11 had to store its part and is gone
    (_entry(to_store=True, stored={11: {}}), 2, {10}, False, False),  # ... but had stored it first
    (_entry(stored_by_loop=True, stored_by_ranks={1}), 2, {10}, False, True),  # the rank that stored it itself is gone
    (_entry(stored_by_loop=True, stored_by_ranks={0, 1}), 2, {10}, False, False),  # one of those that did lives
    (_entry(to_store=False), 2, {10, 11}, True, False),  # replaceable, but of the current generation
    (_entry(generation=1, to_store=False), 1, {10, 11}, True, True),  # replaced by the newer generation's
    (_entry(generation=1, to_store=False, stored={10: {}}), 1, {10, 11}, True, False),  # already stored
])
def test_a_checkpoint_held_back_is_let_through_without_it_only_when_it_can_no_longer_commit(
        entry, generation, live, replaceable, expected):
    assert policy.hopeless(entry, generation, current_generation=2, live=live, members={0: 10, 1: 11},
                           replaceable=replaceable) is expected


@pytest.mark.timeout(10)
def test_the_run_ends_by_storing_the_newest_checkpoint_held_only_when_storage_lacks_it():
    newest = ResumePlan(8, {10: ["model.pt"]}, generation=2)
    assert policy.final_flush(newest, 5, None, live={10, 11}, failed=False) is newest  # nothing of it in storage
    assert policy.final_flush(newest, 8, None, live={10, 11}, failed=False) is None  # committed already
    assert policy.final_flush(newest, 5, _entry(stored={10: {}}), live={10, 11}, failed=False) is None  # on its way
    assert policy.final_flush(newest, 5, _entry(to_store=True, stored={10: {}}), live={10, 11},
                              failed=False) is None  # worker 11 is still storing its part
    # ... but it is gone without telling it stored (its notice may have died with it): the holders store it
    assert policy.final_flush(newest, 5, _entry(to_store=True, stored={10: {}}), live={10}, failed=False) is newest
    assert policy.final_flush(newest, 5, _entry(to_store=True, stored={10: {}}, given_up=True), live={10},
                              failed=False) is None  # a part given up: it never commits
    assert policy.final_flush(newest, 5, _entry(stored={10: {}}), live={10, 11},
                              failed=True) is newest  # a failed run's, whatever
    assert policy.final_flush(ResumePlan(8, state_only=True), 5, None, live=set(),
                              failed=True) is None  # a kept state: never
    assert policy.final_flush(None, 0, None, live=set(), failed=True) is None


@pytest.mark.timeout(10)
def test_workers_leaving_under_a_notice_hand_over_or_store_what_only_they_hold():
    whole, kept = ResumePlan(8), ResumePlan(6)
    assert policy.hand_over(whole, kept, anyone_stays=True) is policy.HandOver.MOVE
    assert policy.hand_over(whole, None, anyone_stays=False) is policy.HandOver.STORE
    assert policy.hand_over(whole, ResumePlan(8), anyone_stays=True) is policy.HandOver.NOTHING  # held by who stays
    assert policy.hand_over(ResumePlan(8, state_only=True), None, anyone_stays=False) is policy.HandOver.NOTHING
    assert policy.hand_over(None, None, anyone_stays=True) is policy.HandOver.NOTHING


# -- the next generation: who is in it, at which rank, who keeps whose copy ----------------------
def _worker(worker_id: int, node: str, generation: int = -1, rank: int = -1) -> WorkerRecord:
    return WorkerRecord(worker_id, actor=None, node_id=node, generation=generation, rank=rank)


@pytest.mark.timeout(10)
def test_a_generation_keeps_its_survivors_numbers_and_fills_the_ranks_of_those_gone_up_to_the_maximum():
    # Generation 3 had workers 7 (rank 0), 5 (rank 2) and 9 (rank 1); rank 1 is gone, 2 and 4 are new,
    # and worker 6 sat out generation 3 as a standby (rank -1): a newcomer too.
    candidates = [_worker(5, "b", 3, 2), _worker(4, "a"), _worker(7, "a", 3, 0), _worker(2, "b"), _worker(6, "c", 3, -1)]
    plan = plan_generation(candidates, generation=3, max_workers=4, replicate=True)
    assert {wid: p.rank for wid, p in plan.placements.items()} == {7: 0, 2: 1, 5: 2, 4: 3}  # 5 keeps rank 2
    assert list(plan.placements) == [7, 2, 5, 4] and plan.master == 7  # rank 0 stays rank 0
    assert plan.buddies == {7: 2, 2: 5, 5: 4, 4: 7}  # the next rank keeps a copy, in a ring
    assert {wid: (p.node_rank, p.local_rank, p.local_world_size) for wid, p in plan.placements.items()} == {
        7: (0, 0, 2), 2: (1, 0, 2), 5: (1, 1, 2), 4: (0, 1, 2)}
    # A survivor of an older generation is a newcomer; alone, or without replication, nobody keeps a copy.
    alone = plan_generation([_worker(8, "a", 1, 0)], generation=3, max_workers=4, replicate=True)
    assert alone.master == 8 and alone.buddies == {}
    assert plan_generation(candidates, generation=3, max_workers=2, replicate=False).buddies == {}


@pytest.mark.timeout(10)
def test_a_replacement_takes_the_lost_rank_and_the_survivors_keep_their_places():
    # Rank 0 of three on node "a" was lost; the spares on "b" (worker 3) and "a" (worker 8) are ready.
    survivors = [_worker(5, "a", 3, 1), _worker(6, "a", 3, 2)]
    plan = plan_generation([*survivors, _worker(3, "b"), _worker(8, "a")], generation=3, max_workers=3,
                           replicate=False, vacated={0: "a"})
    assert {wid: (p.rank, p.local_rank, p.node_rank) for wid, p in plan.placements.items()} == {
        8: (0, 0, 0), 5: (1, 1, 0), 6: (2, 2, 0)}  # the spare on the lost rank's node, at its number
    assert plan.master == 8
    # Without a replacement the survivors close ranks (a world of 2 has no rank 2), rank order kept.
    shrunk = plan_generation(survivors, generation=3, max_workers=3, replicate=False, vacated={0: "a"})
    assert {wid: p.rank for wid, p in shrunk.placements.items()} == {5: 0, 6: 1}
    # A survivor whose number is past the new world: every rank closes up, the newcomer last.
    grown = plan_generation([_worker(5, "a", 3, 3), _worker(6, "a", 3, 0), _worker(9, "b")], generation=3,
                            max_workers=3, replicate=False, vacated={1: "a", 2: "a"})
    assert {wid: p.rank for wid, p in grown.placements.items()} == {6: 0, 5: 1, 9: 2}


@pytest.mark.timeout(10)
def test_each_member_is_told_its_place_the_rendezvous_of_rank_0_and_its_buddy():
    candidates = [_worker(5, "b", 3, 1), _worker(7, "a", 3, 0), _worker(2, "b")]
    for w, (ip, port) in zip(candidates, [("10.0.0.2", 5005), ("10.0.0.1", 7007), ("10.0.0.2", 2002)]):
        w.ip, w.store_port, w.actor = ip, port, f"actor {w.worker_id}"
    plan = plan_generation(candidates, generation=3, max_workers=4, replicate=True)
    resume = ResumePlan(12, {7: ["model.pt"]}, generation=3)
    places = assignments(plan, candidates, 4, resume, max_workers=4)
    assert {wid: (a.rank, a.world_size, a.generation) for wid, a in places.items()} == {
        7: (0, 3, 4), 5: (1, 3, 4), 2: (2, 3, 4)}
    assert {(a.master_addr, a.master_port) for a in places.values()} == {("10.0.0.1", 7007)}  # rank 0's
    assert {wid: a.buddy for wid, a in places.items()} == {7: "actor 5", 5: "actor 2", 2: "actor 7"}
    assert all(a.resume is resume and a.max_world_size == 4 and set(a.peers) == {2, 5, 7} for a in places.values())


# -- what is stored, when a preempted group re-forms, when the run has failed too often ---------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("decided, stored_by_loop, store, carries_files, sync, due, expected", [
    (None, True, None, True, False, False, True),  # the loop stored it itself: committed once listed
    (None, False, True, True, False, False, True),  # a live dict part a rank found due
    (None, False, False, True, False, True, None),  # a live dict part not due: the cadence is not asked
    (True, False, False, True, False, False, True),  # ... but a peer found it due: stored
    (None, False, None, True, True, False, True),  # SYNC waits for its commit: stored whatever the cadence
    (None, False, None, True, False, True, True),  # the first report of a checkpoint asks the cadence
    (None, False, None, True, False, False, False),
    (False, False, None, True, False, True, False),  # decided by its first report: not asked again
    (None, False, None, False, False, True, None),  # no checkpoint: nothing to decide
])
def test_which_reported_checkpoint_is_stored(decided, stored_by_loop, store, carries_files, sync, due, expected):
    asked = []

    def cadence() -> bool:
        asked.append(True)
        return due

    assert policy.to_store(decided, stored_by_loop=stored_by_loop, store=store, carries_files=carries_files, sync=sync,
                           due=cadence) is expected
    assert len(asked) <= 1 and (not asked or (carries_files and decided is None and not sync and not stored_by_loop
                                              and store is None))


@pytest.mark.timeout(10)
def test_a_preempted_group_re_forms_at_the_next_report_unless_its_loop_asks_first():
    assert policy.resize_point(latest=7, loop_asks=False) == 8
    assert policy.resize_point(latest=7, loop_asks=True) is None


@pytest.mark.timeout(10)
def test_the_run_fails_once_its_failures_exceed_max_failures():
    assert not policy.out_of_failures(1, FailureConfig(max_failures=1))
    assert policy.out_of_failures(2, FailureConfig(max_failures=1))
    assert policy.out_of_failures(1, FailureConfig(max_failures=0))
    assert not policy.out_of_failures(10**6, FailureConfig(max_failures=-1))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("positions, expected", [
    ([Position(4, 2), Position(4, 2)], Position(4, 2)),  # survivors at one step go on in place
    ([Position(4, 0, "report")] * 3, Position(4, 0, "report")),
    ([Position(4, 2), Position(4, 3)], None),  # one reduced a step the other did not: entered afresh
    ([Position(4, 0), Position(4, 0, "report")], None),  # one at the report's barrier, one past it
    ([Position(4, 1), Position(4, 1, "ddp")], None),  # one in the step's reduction, one in DDP's map of used parameters
    ([Position(4, 1, "collective", 2)] * 2, Position(4, 1, "collective", 2)),  # both failed in the loop's third
    ([Position(4, 1, "collective", 2), Position(4, 1, "collective", 1)], None),  # one passed a collective the other failed in
    ([Position(4, 1, "rooted", 2)] * 2, Position(4, 1, "rooted", 2)),  # a broadcast from rank 0, which survived
    ([Position(4, 0), None], None),  # a newcomer: it has no state to go on from
    ([], None),
])
def test_the_next_generation_goes_on_in_place_only_from_one_position(positions, expected):
    assert policy.in_place(positions, list(range(len(positions)))) == expected


@pytest.mark.timeout(10)
def test_a_broadcast_from_rank_0_goes_on_in_place_only_if_rank_0_survived():
    """Rank 1's input to the broadcast is its receive buffer: made again with it as the new rank 0, it
    would hand every survivor what rank 1 was to receive."""
    at = Position(4, 1, "rooted", 2)
    assert policy.in_place([at, at], [0, 2]) == at
    assert policy.in_place([at, at], [1, 2]) is None
    gradients = Position(4, 1, "gradients", 0)
    assert policy.in_place([gradients, gradients], [1, 2]) == gradients


@pytest.mark.timeout(10)
@pytest.mark.parametrize("in_place, expected", [(True, Do.OPEN), (False, Do.SCHEDULE)])
def test_a_fixed_size_run_goes_on_below_its_size_in_place_while_its_replacement_starts(in_place, expected):
    survivor = [Member(0, 0, exit=Exit.UNWOUND), Member(1, 1, lost=True)]
    decision = policy.restarting(survivor, parked=1, waited_s=0.2, drain_timeout_s=30, scaling=FIXED_2,
                                 error_counted=False, in_place=in_place)
    assert decision.do is expected
    assert ("replacement" in decision.reason) is in_place, "a run below its size says so"
    nobody = policy.restarting([Member(0, 0, lost=True)], parked=0, waited_s=0.2, drain_timeout_s=30,
                               scaling=FIXED_2, error_counted=False, in_place=True)
    assert nobody.do is Do.SCHEDULE


@pytest.mark.timeout(10)
@pytest.mark.parametrize("at, newest, join", [
    (Position(8, 0, "leave"), 8, True),  # every rank left at the report that made the newest checkpoint
    (Position(9, 0, "leave"), 8, False),  # a report of metrics alone: the survivors would redo a step
    (Position(8, 3), 8, False),  # three steps done since the newest checkpoint: they would be redone
    (Position(8, 0), 8, True),  # in the step after it: that step alone is run again, at the larger size
    (Position(8, 0, "report"), 8, True),  # in the barrier of the report that made it
    (Position(8, 0, "collective", 2), 8, True),
    (Position(8, 0, "leave"), None, False),
    (Position(8, 0), None, False),
])
def test_newcomers_join_survivors_where_every_loop_reenters_from_their_last_report(at, newest, join):
    """As Ray's restart at the size it finds: a ready spare is in the run at the loss."""
    assert policy.newcomers_join(at, newest) is join


@pytest.mark.timeout(10)
def test_a_fixed_size_run_whose_worker_leaves_goes_on_in_place_while_its_replacement_starts():
    members = [Member(0, 0, Exit.UNWOUND), Member(1, 1, Exit.UNWOUND, leaving=True)]
    assert _running(members, resizing=True, standby=0, scaling=FIXED_2, in_place=True).do is Do.OPEN
    assert _running(members, resizing=True, standby=0, scaling=FIXED_2).do is Do.SCHEDULE
