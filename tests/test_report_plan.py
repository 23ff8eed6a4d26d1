"""What one report() does (worker/report/plan.py), over the combinations the Ray tests sample: what it
carries, whether the supervisor decides on it, whether it goes on before its barrier, whether it is
sent in a batch or answered, whether it waits for its commit (no Ray, no process group here)."""

from __future__ import annotations

import pytest

from elastic_train.checkpoint.modes import CheckpointUploadMode
from elastic_train.worker.report.barrier import Agreed
from elastic_train.worker.report.plan import Carries, ReportPlan, after_barrier, plan_report

ASYNC, SYNC, NO_UPLOAD = CheckpointUploadMode.ASYNC, CheckpointUploadMode.SYNC, CheckpointUploadMode.NO_UPLOAD
PLAIN = Agreed(checkpoint=False, unwind=False, every_part=False, store_live=False)


def _plan(checkpoint: bool = True, in_memory: bool = False, mode: CheckpointUploadMode = ASYNC, user_upload: bool = False,
          named: bool = False, keeps_state: bool = False, live_due: bool = False, stores_every: bool = False) -> ReportPlan:
    return plan_report(checkpoint=checkpoint, in_memory=in_memory, mode=mode, user_upload=user_upload, named=named,
                       keeps_state=keeps_state, live_due=live_due, stores_every=stores_every)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, carries, decide, store, waits_commit", [
    (dict(checkpoint=False), Carries.NOTHING, False, None, False),  # metrics alone
    (dict(checkpoint=False, keeps_state=True, live_due=True), Carries.KEPT, False, False, False),  # never stored
    (dict(), Carries.FILES, True, None, False),  # a folder: the supervisor decides on its storing
    (dict(mode=SYNC), Carries.FILES, True, None, True),
    (dict(in_memory=True, mode=SYNC), Carries.FILES, True, None, True),  # a dict stored now: serialized at once
    (dict(in_memory=True), Carries.LIVE, False, False, False),  # a live dict part: its ranks decide
    (dict(in_memory=True, live_due=True), Carries.LIVE, False, True, False),
    (dict(in_memory=True, named=True, live_due=True), Carries.LIVE, True, True, False),  # named: the supervisor
    (dict(mode=NO_UPLOAD), Carries.LOOP_STORED, True, None, True),  # the loop stored it: listed, then committed
    (dict(in_memory=True, user_upload=True), Carries.LOOP_STORED, True, None, True),  # upload_fn: as NO_UPLOAD
    (dict(checkpoint=False, user_upload=True), Carries.NOTHING, False, None, False),  # upload_fn, no checkpoint
])
def test_what_a_report_carries(kwargs, carries, decide, store, waits_commit):
    plan = _plan(**kwargs)
    assert (plan.carries, plan.decide, plan.store, plan.waits_commit) == (carries, decide, store, waits_commit)
    assert plan.part is (carries in (Carries.FILES, Carries.LIVE))
    assert plan.checkpoint is kwargs.get("checkpoint", True)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs, ranks_store", [
    (dict(), True),  # every checkpoint stored: each rank stores its folder's files, no one asks
    (dict(named=True), False),  # a named folder: the supervisor says which name
    (dict(mode=SYNC), False),  # SYNC waits for its commit through the supervisor
    (dict(stores_every=False), False),  # a cadence: the supervisor chooses
    (dict(in_memory=True), False),  # a live dict part: its ranks decide at the barrier, as before
])
def test_without_a_cadence_the_ranks_store_a_folders_files_themselves(kwargs, ranks_store):
    plan = _plan(**{"stores_every": True, **kwargs})
    assert (plan.store is True and not plan.decide and plan.carries is Carries.FILES) is ranks_store
    agreed = Agreed(checkpoint=plan.decides(["model.pt"]), unwind=False, every_part=False, store_live=False,
                    some_part=True, part_ranks=(0,))
    after = _after(plan, agreed)
    assert after.uploads_files is ranks_store
    if plan.carries is not Carries.LIVE:  # a live part not due is batched too, and not uploaded
        assert after.round_trip is not ranks_store
    # Files named as a dict part's: only the lowest rank stores those, which the supervisor names.
    assert _plan(stores_every=True).decides(["dict_checkpoint.pt"]) and not _plan(stores_every=True).decides(["a.pt"])


@pytest.mark.timeout(10)
def test_upload_fn_makes_the_report_no_upload_and_sync_only_when_asked():
    assert _plan(mode=SYNC, user_upload=True).mode is NO_UPLOAD
    assert not _plan(mode=SYNC, user_upload=True).sync
    assert _plan(mode=SYNC).sync and not _plan().sync
    assert _plan(checkpoint=False, mode=SYNC, user_upload=True).mode is SYNC  # nothing was uploaded


@pytest.mark.timeout(10)
@pytest.mark.parametrize("plan, unwind_due, previous, pipelined, expected", [
    (_plan(checkpoint=False), False, PLAIN, True, True),  # plain after plain: on at once
    (_plan(checkpoint=False, keeps_state=True), False, PLAIN, True, True),  # a kept state too
    (_plan(in_memory=True), False, PLAIN, True, False),  # a checkpoint waits
    (_plan(checkpoint=False), True, PLAIN, True, False),  # asked to unwind: waits
    (_plan(checkpoint=False), False, None, True, False),  # a generation's first report
    (_plan(checkpoint=False), False, PLAIN, False, False),  # NCCL, or alone
])
def test_which_reports_go_on_before_their_barrier(plan, unwind_due, previous, pipelined, expected):
    assert plan.goes_on(unwind_due, previous, pipelined) is expected


def _after(plan: ReportPlan, agreed: Agreed, rank: int = 0, previous: Agreed | None = PLAIN, pipelined: bool = False,
           leaving_here: bool = False):
    return after_barrier(plan, agreed, previous=previous, pipelined=pipelined, leaving_here=leaving_here, rank=rank)


@pytest.mark.timeout(10)
def test_a_checkpoint_the_supervisor_decides_on_is_a_round_trip():
    after = _after(_plan(), Agreed(checkpoint=True, unwind=False, every_part=False, store_live=False, some_part=True))
    assert after.round_trip and not after.stores_live and not after.keeps_unstored and not after.unwind


@pytest.mark.timeout(10)
@pytest.mark.parametrize("rank, every_part, keeps", [(0, True, True), (1, True, False), (1, False, True)])
def test_a_live_part_not_due_is_batched_and_kept_to_store_if_the_loop_ends(rank, every_part, keeps):
    """Every rank holding its live part: rank 0 alone stores it if the loop ends there."""
    agreed = Agreed(checkpoint=False, unwind=False, every_part=every_part, store_live=False, some_part=True)
    after = _after(_plan(in_memory=True), agreed, rank=rank)
    assert not after.round_trip and after.store is False and not after.stores_live
    assert after.keeps_unstored is keeps


@pytest.mark.timeout(10)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_live_part_due_on_every_rank_is_stored_by_rank_zero_without_asking(rank):
    agreed = Agreed(checkpoint=False, unwind=False, every_part=True, store_live=True, some_part=True)
    after = _after(_plan(in_memory=True, live_due=True), agreed, rank=rank)
    assert not after.round_trip and after.store is True and after.stores_live
    assert after.uploads_live is (rank == 0) and not after.keeps_unstored


@pytest.mark.timeout(10)
def test_a_live_part_due_that_not_every_rank_holds_asks_the_supervisor():
    agreed = Agreed(checkpoint=False, unwind=False, every_part=False, store_live=True, some_part=True)
    after = _after(_plan(in_memory=True, live_due=True), agreed)
    assert after.round_trip and not after.stores_live and not after.uploads_live


@pytest.mark.timeout(10)
@pytest.mark.parametrize("some_part, drops", [(True, True), (False, False)])
def test_a_kept_state_gives_way_to_a_peers_checkpoint(some_part, drops):
    agreed = Agreed(checkpoint=False, unwind=False, every_part=False, store_live=False, some_part=some_part)
    after = _after(_plan(checkpoint=False, keeps_state=True), agreed)
    assert after.drops_kept is drops and not after.round_trip and after.store is False
    assert not after.keeps_unstored


@pytest.mark.timeout(10)
@pytest.mark.parametrize("previous, pipelined, leaving_here, together", [
    (PLAIN, False, False, True),  # every report waits (NCCL, alone)
    (None, True, False, True),  # a generation's first report
    (PLAIN, True, False, False),  # peers may have gone on: they unwind after the next report
    (PLAIN, True, True, True),  # every rank asked to leave here alike
    (Agreed(checkpoint=True, unwind=False, every_part=False, store_live=False), True, False, True),
])
def test_an_unwind_is_acted_on_when_every_rank_waited(previous, pipelined, leaving_here, together):
    agreed = Agreed(checkpoint=False, unwind=True, every_part=False, store_live=False)
    after = _after(_plan(checkpoint=False), agreed, previous=previous, pipelined=pipelined, leaving_here=leaving_here)
    assert after.together is together and after.unwind is together


@pytest.mark.timeout(10)
@pytest.mark.parametrize("agreed, kept, leaves_here", [
    (dict(unwind=True), False, True),  # a peer leaves: at this report, whatever it carries
    (dict(grow=True), False, False),  # newcomers wait for a report that carries a checkpoint ...
    (dict(grow=True, some_part=True), False, True),  # ... a part on some rank (rank 0 alone saves)
    (dict(grow=True, checkpoint=True), False, True),  # ... a checkpoint the loop stored itself
    (dict(grow=True), True, True),  # ... or the state kept live, at any report
    (dict(), True, False),
])
def test_newcomers_join_at_a_report_that_carries_what_they_start_from(agreed, kept, leaves_here):
    from elastic_train.worker.report.plan import leaves

    flags = dict(checkpoint=False, unwind=False, every_part=False, store_live=False) | agreed
    assert leaves(Agreed(**flags), kept=kept) is leaves_here
    assert Agreed(**flags).notable or not any(agreed.values()), "a report with a growth due waits for its barrier"
