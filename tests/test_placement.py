"""Where a new worker goes (supervisor/placement.py): pure decisions, tested without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from ray.util.placement_group import NODE_ID_LABEL_KEY

from elastic_train.supervisor.bundles import assign
from elastic_train.supervisor.placement import (Node, avoiding, free_slots, matches, pack_node, placeable,
                                               selector_for, slot_of, spare_nodes, spread_node, successor)

CPU = {"CPU": 1.0}


def nodes(*specs: tuple[str, float, dict]) -> list[Node]:
    return [Node(node_id, labels, {"CPU": cpus}) for node_id, cpus, labels in specs]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("selector, labels, expected", [
    (None, {}, True),
    ({"pool": "a"}, {"pool": "a"}, True),
    ({"pool": "a"}, {"pool": "b"}, False),
    ({"pool": "a"}, {}, False),
    ({"pool": "!a"}, {"pool": "b"}, True),
    ({"pool": "!a"}, {}, True),
    ({"pool": "in(a,b)"}, {"pool": "b"}, True),
    ({"pool": "!in(a,b)"}, {"pool": "b"}, False),
    ({"pool": "in(a, b)"}, {"pool": "b"}, True),  # Ray's syntax allows the spaces
    ({"pool": "!in(a, b)"}, {"pool": "b"}, False),
    ({"pool": "a", "zone": "z1"}, {"pool": "a", "zone": "z2"}, False),
])
def test_label_selectors_match_as_rays_syntax_reads(selector, labels, expected):
    assert matches(selector, labels) is expected


@pytest.mark.timeout(10)
def test_pack_fills_the_node_with_most_workers_that_has_room_then_the_roomiest():
    cluster = nodes(("n1", 4, {}), ("n2", 4, {}), ("n3", 8, {}))
    placed: Counter[str] = Counter()
    chosen = []
    for _ in range(10):
        node = pack_node(CPU, cluster, placed)
        placed[node] += 1
        chosen.append(node)
    assert chosen == ["n3"] * 8 + ["n1", "n1"]  # the roomiest first, filled before another is opened
    assert pack_node(CPU, cluster, Counter({"n1": 4, "n2": 4, "n3": 8})) is None  # full: Ray finds it a place
    assert pack_node(CPU, cluster, Counter({"n1": 3, "n3": 8})) == "n1"  # beside the most workers, with room


@pytest.mark.timeout(10)
def test_a_selector_and_a_preemption_notice_narrow_the_nodes_unless_nothing_would_be_left():
    cluster = nodes(("a1", 2, {"pool": "a"}), ("a2", 2, {"pool": "a"}), ("b1", 8, {"pool": "b"}))
    allowed, selector = avoiding(cluster, set(), {"pool": "a"})
    assert [n.node_id for n in allowed] == ["a1", "a2"] and selector == {"pool": "a"}
    allowed, selector = avoiding(cluster, {"a1"}, {"pool": "a"})  # a1 is under a notice: kept off it
    assert [n.node_id for n in allowed] == ["a2"] and selector == {"pool": "a", NODE_ID_LABEL_KEY: "!in(a1)"}
    allowed, selector = avoiding(cluster, {"a1", "a2"}, {"pool": "a"})  # no other pool-a node: not kept off
    assert [n.node_id for n in allowed] == ["a1", "a2"] and selector == {"pool": "a"}
    assert avoiding(cluster, {"b1"}, {})[1] == {NODE_ID_LABEL_KEY: "!in(b1)"}
    assert pack_node(CPU, avoiding(cluster, set(), {"pool": "c"})[0], Counter()) is None
    assert pack_node({"GPU": 1.0}, cluster, Counter()) is None  # no node could ever host it


@pytest.mark.timeout(10)
def test_what_could_be_placed_counts_each_slot_on_a_node_its_selector_allows():
    cluster = nodes(("a1", 2, {"pool": "a"}), ("b1", 8, {"pool": "b"}))
    assert placeable(CPU, cluster, None, 4) == 4
    assert placeable(CPU, cluster, {"pool": "a"}, 4) == 2  # pool a has room for two
    assert placeable(CPU, cluster, [{"pool": "a"}, {"pool": "c"}, {"pool": "b"}], 3) == 2


@pytest.mark.timeout(10)
def test_each_slot_has_its_selector_and_a_replacement_takes_the_lost_workers_slot():
    assert selector_for(None, 1) == {}
    assert selector_for({"pool": "a"}, 1) == {"pool": "a"}
    assert selector_for([{"pool": "a"}, {"pool": "b"}], 1) == {"pool": "b"}
    assert free_slots(set(), 3, 3) == [0, 1, 2]
    assert free_slots({0, 2}, 3, 1) == [1]  # slot 1's worker was lost: its replacement is slot 1
    assert free_slots({0, 1, 2}, 3, 0) == []
    assert free_slots({0}, 4, -1) == []  # more alive than the maximum (a leaving one adopted): none requested
    # A worker adopted by a restarted supervisor gets the slot its node's labels fit.
    assert slot_of({"pool": "b"}, [{"pool": "a"}, {"pool": "b"}], [0, 1]) == 1
    assert slot_of({"pool": "c"}, [{"pool": "a"}, {"pool": "b"}], [1]) == 1
    assert slot_of({}, None, [2, 3]) == 2
    assert slot_of({}, None, []) == -1  # every slot filled: an adopted worker beyond them is a spare


@pytest.mark.timeout(10)
def test_warm_spares_of_gpu_workers_go_beside_the_run_s_workers_where_a_node_has_room_for_one_more():
    need = {"CPU": 2.0, "GPU": 1.0}  # a spare holds its own GPU, its CUDA context made
    free = {"a": {"CPU": 4.0, "GPU": 1.0}, "b": {"CPU": 1.0, "GPU": 2.0}, "c": {"CPU": 8.0, "GPU": 8.0}}
    # "b" has no room (one CPU free); "c" hosts none of the run's workers; "a" holds one.
    assert spare_nodes(need, free, {"a", "b"}, Counter(), 1) == ["a"]
    assert spare_nodes(need, free, {"a", "b"}, Counter({"a": 1}), 1) == []  # it has its spare already
    assert spare_nodes(need, free, {"a", "c"}, Counter(), 2) == ["a", "c", "c"]  # as many as room holds
    assert spare_nodes(need, free, {"a"}, Counter(), 0) == []  # turned off
    assert spare_nodes({}, {**free, "d": {}}, {"d"}, Counter(), 1) == ["d"]  # a worker that asks for nothing fits anywhere
    assert spare_nodes(need, free, {"a"}, Counter(), 1, leave={"CPU": 3.0}) == []  # Ray Data's CPUs kept free
    assert spare_nodes(need, free, {"a", "c"}, Counter(), 2, leave={"CPU": 1.0}) == ["a", "c", "c"]


@pytest.mark.timeout(10)
def test_warm_spares_that_hold_nothing_go_beside_the_run_s_workers_on_full_nodes_too():
    free = {"a": {"CPU": 0.0}, "b": {"CPU": 3.0}}  # "a" is full: its spare takes over a lost worker's bundle
    assert spare_nodes(CPU, free, {"a", "b"}, Counter(), 1) == ["a", "b"]
    assert spare_nodes(CPU, free, {"a", "b"}, Counter({"a": 1}), 2) == ["a", "b", "b"]
    assert spare_nodes(CPU, free, {"a"}, Counter(), 1, leave={"CPU": 3.0}) == ["a"]  # Ray Data's CPU is not taken
    assert spare_nodes(CPU, free, {"a"}, Counter(), 0) == []
    assert spare_nodes(CPU, free, {"a", "gone"}, Counter(), 1) == ["a"]  # a node gone: its workers are being lost


@pytest.mark.timeout(10)
def test_the_spare_that_replaces_a_lost_worker_is_on_its_node_and_ready_first():
    spares = [(7, "b", True), (5, "a", False), (9, "a", True)]
    assert successor("a", spares, anywhere=False) == 9  # on the lost worker's node, ready
    assert successor("a", [(5, "a", False)], anywhere=False) == 5  # still starting: sooner than a new one
    assert successor("c", spares, anywhere=False) is None  # none there to take the bundle over
    assert successor("c", spares, anywhere=True) == 7  # spares holding their own GPU replace anywhere
    assert successor("a", [], anywhere=True) is None


@pytest.mark.timeout(10)
def test_spread_puts_the_next_worker_on_the_node_with_room_that_hosts_the_fewest():
    cluster = nodes(("a", 4, {}), ("b", 2, {}), ("c", 1, {}))
    assert spread_node(CPU, cluster, Counter({"a": 1})) == "b"  # of the empty ones, the roomiest
    assert spread_node(CPU, cluster, Counter({"a": 1, "b": 1})) == "c"
    assert spread_node(CPU, cluster, Counter({"a": 1, "b": 1, "c": 1})) == "a"
    assert spread_node(CPU, nodes(("a", 1, {})), Counter({"a": 1})) is None  # no room anywhere


@pytest.mark.timeout(10)
def test_a_restarted_supervisor_gives_each_worker_the_bundle_it_runs_in_then_one_left_on_its_node():
    groups = {"g1": "a", "g2": "a", "g3": "b", "g4": "c"}
    # workers: in g2 on a; a spare that took a bundle over on a; in g3 on b; a spare on b with none left
    held = assign(groups, [("g2", "a"), ("", "a"), ("g3", "b"), ("", "b")])
    assert held == ["g2", "g1", "g3", None]  # g4 (its worker gone) is left: the supervisor removes it
    # a worker in a group is never handed another worker's: the resident's own comes first
    assert assign({"g1": "a", "g2": "a"}, [("", "a"), ("g1", "a")]) == ["g2", "g1"]
