"""Where a new worker should go: `ScalingConfig.placement_strategy` and `label_selector`, as Ray Train
places its placement group's bundles, for workers that are single actors.

Ray Train reserves one placement group for the whole worker group; elastic_train's workers come and go
one by one (a replacement, a worker added to a range), so each is placed on its own. PACK and STRICT_PACK
ask for the node that already hosts most of the run's workers and has room for one more (a preference:
a node whose room another job took spills the worker elsewhere); SPREAD and STRICT_SPREAD use
Ray's SPREAD strategy. A list of label selectors gives each worker slot its own, as Ray gives each
bundle; a replacement takes the slot of the worker it replaces. Pure functions of what the roster knows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

Selector = Mapping[str, str]


@dataclass(frozen=True)
class Node:
    """An alive node the run may use: its id, labels and total resources."""

    node_id: str
    labels: Mapping[str, str]
    resources: Mapping[str, float]


def matches(selector: Selector | None, labels: Mapping[str, str]) -> bool:
    """Does a node with `labels` satisfy `selector`? Ray's syntax: `v`, `!v`, `in(a,b)`, `!in(a,b)`."""
    for key, wanted in (selector or {}).items():
        negated = wanted.startswith("!")
        wanted = wanted[1:] if negated else wanted
        values = set(wanted[3:-1].split(",")) if wanted.startswith("in(") and wanted.endswith(")") else {wanted}
        if (labels.get(key) in values) == negated:
            return False
    return True


def selector_for(label_selector: Selector | Sequence[Selector] | None, slot: int) -> dict[str, str]:
    """The label selector of worker slot `slot`: the one given for every worker, or the slot's own."""
    if label_selector is None:
        return {}
    return dict(label_selector if isinstance(label_selector, Mapping) else label_selector[slot])


def free_slots(taken: set[int], max_workers: int, count: int) -> list[int]:
    """The `count` lowest slots not `taken` (a worker under a preemption notice frees its slot for its
    replacement)."""
    return [slot for slot in range(max_workers) if slot not in taken][:count]


def pack_node(need: Mapping[str, float], nodes: Sequence[Node], placed: Counter[str],
              selector: Selector | None) -> str | None:
    """PACK's node for one more worker needing `need`, given how many of the run's workers each node
    has or is about to get (`placed`): of the nodes matching `selector` with room for it, the one with
    the most of them, then the roomiest; None where none has room (the worker then waits for capacity
    wherever Ray finds it)."""

    def room(node: Node) -> int:
        return min((int(node.resources.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0),
                   default=1 << 30) - placed[node.node_id]

    with_room = sorted((n for n in nodes if matches(selector, n.labels) and room(n) > 0),
                       key=lambda n: n.node_id)  # of equals, max() takes the first: the lowest id
    return max(with_room, key=lambda n: (placed[n.node_id], room(n))).node_id if with_room else None
