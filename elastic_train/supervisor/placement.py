"""Where a new worker should go: `ScalingConfig.placement_strategy` and `label_selector`, as Ray Train
places its placement group's bundles, for workers that each have a group of one bundle.

Ray Train reserves one placement group for the whole worker group; elastic_train's workers come and go
one by one (a replacement, a worker added to a range), so each is placed on its own. PACK and STRICT_PACK
ask for the node that already hosts most of the run's workers and, by its total resources less the
run's own workers there, has room for one more; SPREAD and STRICT_SPREAD the node with room that hosts
the fewest (a preference: a node whose room other work holds leaves the bundle to wherever Ray places it). A list of
label selectors gives each worker slot its own, as Ray gives each bundle; a replacement takes the slot
of the worker it replaces. Warm spares (`ElasticConfig.warm_spares_per_node`) go beside the run's
workers, and one takes the place of a worker lost on its node. Pure functions of what the roster knows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from ray.util.placement_group import NODE_ID_LABEL_KEY

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
        wanted = wanted.strip()
        negated = wanted.startswith("!")
        wanted = wanted[1:].strip() if negated else wanted
        inside = wanted[3:-1] if wanted.startswith("in(") and wanted.endswith(")") else None
        values = {v.strip() for v in inside.split(",")} if inside is not None else {wanted}
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
    replacement); none when `count` is not positive."""
    return [slot for slot in range(max_workers) if slot not in taken][:max(count, 0)]


def slot_of(labels: Mapping[str, str], label_selector: Selector | Sequence[Selector] | None, free: list[int]) -> int:
    """The slot of a worker found running on a node with `labels` (a restarted supervisor adopting it):
    the first free slot whose selector that node satisfies, else the first free one; -1 (a spare) when
    none is free."""
    return next((s for s in free if matches(selector_for(label_selector, s), labels)), free[0] if free else -1)


def avoiding(nodes: Sequence[Node], leaving: set[str], selector: Selector) -> tuple[list[Node], dict[str, str]]:
    """The nodes a worker with `selector` may go to, and the selector that keeps it off machines under
    a preemption notice, unless no other matching machine is left (or the user selects on node ids)."""
    matching = [n for n in nodes if matches(selector, n.labels)]
    staying = [n for n in matching if n.node_id not in leaving]
    if not staying or len(staying) == len(matching) or NODE_ID_LABEL_KEY in selector:
        return matching, dict(selector)
    away = sorted(n.node_id for n in matching if n.node_id in leaving)
    return staying, {**selector, NODE_ID_LABEL_KEY: f"!in({','.join(away)})"}


def fits(need: Mapping[str, float], resources: Mapping[str, float]) -> int:
    """How many workers needing `need` `resources` hold (a worker that asks for nothing: any number)."""
    return min((int(resources.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0), default=1 << 30)


def _room(need: Mapping[str, float], node: Node, placed: Counter[str]) -> int:
    """How many more workers needing `need` the node holds, by its totals less the run's own there."""
    return fits(need, node.resources) - placed[node.node_id]


def pack_node(need: Mapping[str, float], nodes: Sequence[Node], placed: Counter[str]) -> str | None:
    """PACK's node for one more worker needing `need` among `nodes` (those its selector allows), given
    how many of the run's workers each node has or is about to get (`placed`): of those with room, the
    one with the most of them, then the roomiest; None where none has room (the worker then waits for
    capacity wherever Ray finds it)."""
    with_room = sorted((n for n in nodes if _room(need, n, placed) > 0),
                       key=lambda n: n.node_id)  # of equals, max() takes the first: the lowest id
    return max(with_room, key=lambda n: (placed[n.node_id], _room(need, n, placed))).node_id if with_room else None


def placeable(need: Mapping[str, float], nodes: Sequence[Node], label_selector: Selector | Sequence[Selector] | None,
              max_workers: int) -> int:
    """How many of the `max_workers` slots the nodes could host by their totals, each slot on a node
    its selector allows (a bound on what free resources alone would say)."""
    placed: Counter[str] = Counter()
    count = 0
    for slot in range(max_workers):
        allowed = [n for n in nodes if matches(selector_for(label_selector, slot), n.labels)]
        node = pack_node(need, allowed, placed)
        if node is not None:
            placed[node] += 1
            count += 1
    return count


def spare_holds_its_own(need: Mapping[str, float]) -> bool:
    """Does a warm spare hold a worker's resources from its start? Where the worker needs a GPU: the
    spare makes its CUDA context on its own device before it is needed. Elsewhere it holds nothing: it
    takes over the bundle the lost worker's place keeps reserved (supervisor/bundles.py)."""
    return need.get("GPU", 0.0) > 0


def spare_nodes(need: Mapping[str, float], free: Mapping[str, Mapping[str, float]], hosts: set[str],
                spares: Counter[str], per_node: int, leave: Mapping[str, float] | None = None) -> list[str]:
    """Where to start warm spares: each live node that hosts the run's workers (`hosts`), up to
    `per_node` spares there (`spares`: those it has, starting ones included). A spare that holds a
    worker's resources (`spare_holds_its_own`) goes only where the node's free resources (`free`, by
    live node) hold one after `leave` (what the run's Ray Data tasks need to go on): no other job can
    take them."""
    wanted: list[str] = []
    for node in sorted(hosts & free.keys()):  # a node just gone still hosts workers not yet found lost
        left = {k: v - (leave or {}).get(k, 0.0) for k, v in free.get(node, {}).items()}
        room = fits(need, left) if spare_holds_its_own(need) else per_node
        wanted += [node] * max(min(per_node - spares[node], room), 0)
    return wanted


def successor(lost_node: str, spares: Sequence[tuple[int, str, bool]], anywhere: bool) -> int | None:
    """The warm spare (worker id, node, ready) that takes the place of a worker lost on `lost_node`:
    one on that node (it takes over the bundle kept there), a ready one first; with `anywhere` (spares
    that hold their own resources) one on another node where none is on that one; None where none is."""
    ranked = sorted(spares, key=lambda s: (s[1] != lost_node, not s[2], s[0]))
    return next((worker_id for worker_id, node, _ in ranked if node == lost_node or anywhere), None)


def spread_node(need: Mapping[str, float], nodes: Sequence[Node], placed: Counter[str]) -> str | None:
    """SPREAD's node for one more worker: of those with room, the one with the fewest of the run's
    workers, then the roomiest; None where none has room."""
    with_room = sorted((n for n in nodes if _room(need, n, placed) > 0), key=lambda n: n.node_id)
    return min(with_room, key=lambda n: (placed[n.node_id], -_room(need, n, placed))).node_id if with_room else None
