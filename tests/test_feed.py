"""What the driver's callbacks see: every report all ranks made, in order, each once its
checkpoint is settled (supervisor/checkpoints/feed.py). Pure logic, no Ray."""

from __future__ import annotations

import pytest

from elastic_train.protocol import Exit, ReportRecord
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.feed import ReportFeed


def _record(generation: int, index: int) -> ReportRecord:
    return ReportRecord(index, generation, 2, [{"i": index}, {"i": index}])


@pytest.mark.timeout(10)
def test_a_report_waits_for_its_checkpoint_and_holds_back_the_later_ones():
    feed = ReportFeed()
    feed.made(_record(0, 1), awaits_commit=False)
    feed.made(_record(0, 2), awaits_commit=True)
    feed.made(_record(0, 3), awaits_commit=False)
    assert [r.index for r in feed.since(0)] == [1] and not feed.done
    feed.settle(0, 2, "committed-2")
    assert [(r.index, r.checkpoint) for r in feed.since(1)] == [(2, "committed-2"), (3, None)] and feed.done


@pytest.mark.timeout(10)
def test_a_checkpoint_that_never_commits_lets_the_reports_through_without_it():
    feed = ReportFeed()
    feed.made(_record(0, 4), awaits_commit=True)
    feed.made(_record(1, 4), awaits_commit=True)  # the next generation reports index 4 again
    feed.settle(1, 4, "committed-4")  # settling (1, 4) is not settling (0, 4)
    assert feed.since(0) == [] and feed.awaiting() == [(0, 4)]
    feed.settle(0, 4, None)
    assert [(r.generation, r.checkpoint) for r in feed.since(0)] == [(0, None), (1, "committed-4")]
    feed.made(_record(1, 5), awaits_commit=True)
    feed.settle_all()  # the run is over
    assert [r.index for r in feed.since(2)] == [5] and feed.done


@pytest.mark.timeout(10)
def test_a_stop_finishes_once_the_members_left_or_drops_those_that_do_not():
    leaving = [policy.Member(1, 0, exit=Exit.UNWOUND), policy.Member(2, 1, exit=None)]
    assert policy.stopping(leaving, waited_s=1, drain_timeout_s=30).do is policy.Do.WAIT
    late = policy.stopping(leaving, waited_s=31, drain_timeout_s=30)
    assert late.do is policy.Do.FINISH and late.dropped == (2,)
    left = [policy.Member(1, 0, exit=Exit.UNWOUND), policy.Member(2, 1, lost=True)]
    assert policy.stopping(left, waited_s=0, drain_timeout_s=30) == policy.Decision(policy.Do.FINISH)
    assert policy.stopping([], waited_s=0, drain_timeout_s=30).do is policy.Do.FINISH
