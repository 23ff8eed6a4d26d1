"""Where a new worker goes (supervisor/placement.py): pure decisions, tested without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from elastic_train.supervisor.placement import Node, free_slots, matches, pack_node, selector_for

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
        node = pack_node(CPU, cluster, placed, None)
        placed[node] += 1
        chosen.append(node)
    assert chosen == ["n3"] * 8 + ["n1", "n1"]  # the roomiest first, filled before another is opened
    assert pack_node(CPU, cluster, Counter({"n1": 4, "n2": 4, "n3": 8}), None) is None  # full: Ray finds it a place
    assert pack_node(CPU, cluster, Counter({"n1": 3, "n3": 8}), None) == "n1"  # beside the most workers, with room


@pytest.mark.timeout(10)
def test_pack_keeps_to_the_selected_nodes_and_says_none_where_none_fits():
    cluster = nodes(("a1", 2, {"pool": "a"}), ("b1", 8, {"pool": "b"}))
    assert pack_node(CPU, cluster, Counter(), {"pool": "a"}) == "a1"
    assert pack_node(CPU, cluster, Counter({"a1": 2}), {"pool": "a"}) is None  # full: the selector alone places it
    assert pack_node(CPU, cluster, Counter(), {"pool": "c"}) is None
    assert pack_node({"GPU": 1.0}, cluster, Counter(), None) is None  # no node could ever host it


@pytest.mark.timeout(10)
def test_each_slot_has_its_selector_and_a_replacement_takes_the_lost_workers_slot():
    assert selector_for(None, 1) == {}
    assert selector_for({"pool": "a"}, 1) == {"pool": "a"}
    assert selector_for([{"pool": "a"}, {"pool": "b"}], 1) == {"pool": "b"}
    assert free_slots(set(), 3, 3) == [0, 1, 2]
    assert free_slots({0, 2}, 3, 1) == [1]  # slot 1's worker was lost: its replacement is slot 1
    assert free_slots({0, 1, 2}, 3, 0) == []
