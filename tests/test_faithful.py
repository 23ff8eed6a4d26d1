"""Faithful recovery's decisions, without Ray: what a statement does with a read of the loop's place
(faithful/sites.py), which reads a parking survivor brings (faithful/reads.py), and whether the next
generation's places change them (supervisor/policy.py `unfaithful`)."""

from __future__ import annotations

import ast
import json
import os
import sys
import threading

import pytest

from elastic_train.faithful import reads
from elastic_train.faithful.sites import HELD, LOGGED, USED, parents_of, use_of
from elastic_train.protocol import PlaceRead
from elastic_train.supervisor import policy

pytestmark = pytest.mark.timeout(30)


def _use(source: str) -> str:
    """What the statement does with the one `get_world_size()` call in `source`."""
    tree = ast.parse(source)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "get_world_size")
    return use_of(call, parents_of(tree))


@pytest.mark.parametrize("source, use", [
    ("batch = 24 // ctx.get_world_size()", HELD),
    ("self.world = ctx.get_world_size()", HELD),
    ("steps += ctx.get_world_size()", HELD),
    ("sampler = Sampler(data, num_replicas=ctx.get_world_size())", HELD),
    ("def f():\n    return ctx.get_world_size()", HELD),
    ("f = lambda s: s / ctx.get_world_size()", HELD),
    ("for i in range(ctx.get_world_size()):\n    pass", HELD),
    ("def f(w=ctx.get_world_size()):\n    pass", HELD),
    ("with group(ctx.get_world_size()) as g:\n    pass", HELD),
    ("xs = [i for i in range(ctx.get_world_size())]", HELD),
    ("if ctx.get_world_size() > 1:\n    loader.sampler.set_epoch(epoch)", USED),
    ("while step < ctx.get_world_size():\n    pass", USED),
    ("assert ctx.get_world_size() == 2", USED),
    ("loss.div_(ctx.get_world_size())", USED),
    ("(loss / ctx.get_world_size()).backward()", USED),
    ("buf[ctx.get_world_size() - 1] = 0", USED),
    ("loader = prepare_data_loader(DataLoader(data, sampler=DistributedSampler(data, ctx.get_world_size())))", HELD),
    ("print(f'world {ctx.get_world_size()}')", LOGGED),
    ("logger.info('world %d', ctx.get_world_size())", LOGGED),
    ("log_progress(dir, world=ctx.get_world_size())", LOGGED),
    ("writer.add_scalar('world', ctx.get_world_size(), step)", LOGGED),
    ("f.write(json.dumps({'world': ctx.get_world_size()}))", LOGGED),
    ("json.dump({'world': ctx.get_world_size()}, f)", LOGGED),
    ("text = json.dumps({'world': ctx.get_world_size()})", HELD),
])
def test_what_a_statement_does_with_a_read(source, use):
    assert _use(source) == use


@pytest.mark.parametrize("source, use", [
    ("loader = prepare_data_loader(DataLoader(data, sampler=DistributedSampler(data, shuffle=True)))", USED),
    ("sampler = DistributedSampler(data, shuffle=True)", HELD),
])
def test_a_distributed_sampler_handed_to_prepare_data_loader_keeps_nothing_of_its_world(source, use):
    """prepare_data_loader keeps the sampler's shuffle, seed and drop_last, not its replicas or rank."""
    tree = ast.parse(source)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DistributedSampler")
    assert use_of(call, parents_of(tree)) == use


class _Context:
    """Reads as `TrainContext` makes them: `record` of its caller's frame."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def get_world_rank(self) -> int:
        reads.record("rank", self.rank, sys._getframe(1))
        return self.rank

    def get_world_size(self) -> int:
        reads.record("world_size", self.world, sys._getframe(1))
        return self.world


def _sites(found: tuple[PlaceRead, ...]) -> list[tuple[str, int, bool]]:
    return sorted((r.what, r.value, r.held) for r in found)


def test_a_survivor_brings_its_held_reads_and_those_used_in_the_step_under_way():
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        ctx = _Context(1, 3)
        batch = 24 // ctx.get_world_size()  # held
        if ctx.get_world_rank() == 1:  # used where read
            batch += 0
        print(ctx.get_world_rank(), file=open(os.devnull, "w"))  # logged: not recorded
        assert _sites(tracker.relevant("gradients")) == [("rank", 1, False), ("world_size", 3, True)]
        assert _sites(tracker.relevant("leave")) == [("world_size", 3, True)]  # the report they led to was agreed
        tracker.step_done()  # the step's gradients were reduced: what it used is spent
        assert _sites(tracker.relevant("gradients")) == [("world_size", 3, True)]
        site = tracker.relevant("report")[0]
        assert site.site.endswith("test_faithful.py:" + str(site.site.rsplit(":", 1)[1])) and "24 //" in site.text
    finally:
        reads.follow(None)


def test_reads_from_another_thread_or_with_no_loop_are_not_the_loops():
    tracker = reads.PlaceReads()
    ctx = _Context(0, 2)
    ctx.get_world_size()  # no loop follows
    reads.follow(tracker)
    try:
        thread = threading.Thread(target=lambda: 24 // ctx.get_world_size())
        thread.start()
        thread.join()
        assert tracker.relevant("gradients") == ()
    finally:
        reads.follow(None)


def test_the_place_variables_are_read_through_the_environment(monkeypatch):
    reads.track_environment()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        rank = int(os.environ["RANK"])
        if os.environ.get("WORLD_SIZE") == "3":
            rank += 0
        _ = os.environ.get("HOME")  # not a place variable
        assert _sites(tracker.relevant("gradients")) == [("rank", 2, True), ("world_size", 3, False)]
    finally:
        reads.follow(None)


def _read(what: str, value: int, held: bool = True) -> PlaceRead:
    return PlaceRead("train.py:23", what, value, held, "x = ...")


def test_going_on_is_faithful_when_no_read_changes():
    """Rank 1 of 2 lost: rank 0 keeps its number; a loop that holds only its rank goes on."""
    places = [{"rank": 0, "world_size": 1}]
    assert policy.unfaithful([[_read("rank", 0)]], places) is None
    assert policy.unfaithful([[]], places) is None


def test_a_held_world_size_or_a_renumbered_rank_re_enters_and_names_the_line():
    places = [{"rank": 0, "world_size": 2}, {"rank": 1, "world_size": 2}]
    why = policy.unfaithful([[], [_read("world_size", 3)]], places)
    assert why == "train.py:23 holds the world size it read (3, now 2)"
    why = policy.unfaithful([[_read("rank", 0)], [_read("rank", 2, held=False)]], places)
    assert why == "train.py:23 used, in the step the peer was lost in, the rank it read (2, now 1)"


def _save_on_rank_0(ctx: _Context) -> bool:
    rank = ctx.get_world_rank()  # held by this frame alone: `rank` is only compared
    if rank == 0:
        return True
    return False


def _rank_of(ctx: _Context) -> int:
    rank = ctx.get_world_rank()
    return rank  # returned: whoever called holds it


@pytest.mark.parametrize("helper, held_after_return", [(_save_on_rank_0, False), (_rank_of, True)])
def test_a_helpers_local_read_is_held_while_the_helper_runs(helper, held_after_return):
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        helper(_Context(1, 2))
        assert bool(tracker.relevant("report")) == held_after_return
    finally:
        reads.follow(None)


def test_a_read_assigned_afresh_each_step_and_only_used_is_spent_with_the_step():
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        ctx = _Context(1, 2)
        for _ in range(2):
            world = ctx.get_world_size()
            if world > 1:
                pass
        assert [r.what for r in tracker.relevant("gradients")] == ["world_size"]
        tracker.step_done()
        assert tracker.relevant("gradients") == ()
    finally:
        reads.follow(None)


def test_a_read_held_in_names_that_are_only_logged_or_written_out_is_logged():
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        ctx = _Context(1, 2)
        with open(os.devnull, "w") as f:
            for _ in range(2):
                record = {"world": ctx.get_world_size()}
                print(record, file=f)
                f.write(json.dumps(record) + "\n")
                json.dump(record, f)
        assert tracker.relevant("gradients") == ()
    finally:
        reads.follow(None)


def test_what_the_loop_used_after_its_step_is_spent_at_the_next_draw_not_between_micro_batches():
    tracker = reads.PlaceReads()
    reads.follow(tracker)
    try:
        ctx = _Context(1, 2)
        tracker.step_done()  # the step's gradients were reduced
        if ctx.get_world_rank() == 0:  # its optimizer step, its save: used after the step
            pass
        tracker.drawn()  # the next step's first batch
        assert tracker.relevant("gradients") == ()
        if ctx.get_world_size() > 1:  # used in the first micro-batch
            pass
        tracker.drawn()  # its second micro-batch
        assert [r.what for r in tracker.relevant("gradients")] == ["world_size"]
    finally:
        reads.follow(None)


class _Dist:
    def all_reduce(self, value):
        return value


def _sums_all_reduced_after_the_epoch(tracker: reads.PlaceReads) -> tuple[PlaceRead, ...]:
    found: tuple[PlaceRead, ...] = ()
    for _epoch in range(1):
        total = 0
        for step in range(2):
            total += step
            found = tracker.relevant("gradients")  # where a failed collective of the step parks
        _Dist().all_reduce(total)
    return found


def _each_steps_value_all_reduced(tracker: reads.PlaceReads) -> tuple[PlaceRead, ...]:
    found: tuple[PlaceRead, ...] = ()
    for step in range(2):
        _Dist().all_reduce(step)
        found = tracker.relevant("gradients")
    return found


def test_a_collective_after_the_step_loop_combines_per_rank_values_and_is_not_faithful_to_go_on():
    """faithful/combines.py: per-rank sums all-reduced after the epoch's steps would miss a lost rank's
    share if the loop went on in place; a collective of each step's own values would not."""
    found = _sums_all_reduced_after_the_epoch(reads.PlaceReads())
    assert [(r.what, r.text) for r in found] == [("combined", "_Dist().all_reduce(total)")]
    why = policy.unfaithful([found], [{"rank": 0, "world_size": 1}])
    assert why.startswith("tests/test_faithful.py:") and "combines, after the steps it stands in" in why
    assert _each_steps_value_all_reduced(reads.PlaceReads()) == ()
