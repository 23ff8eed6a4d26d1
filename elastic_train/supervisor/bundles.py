"""What the run reserves for its workers with Ray: one placement group of one bundle per worker,
kept when its process dies.

Why: a worker process that dies frees what it held, and another job could take it before a
replacement is placed. A bundle the run keeps does not free it: the warm spare on that node takes it
over at the loss (a spare that holds nothing of its own: `ElasticConfig.warm_spares_per_node`), and a
bundle no spare takes is removed once its worker has ended. The groups are the supervisor's, scoped to
the driver's job: they outlive a supervisor that Ray restarts (which finds them again by name:
`adopt`), and end with the job at the latest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A bundle of the run found after a supervisor restart: its group and its node ('' while unplaced)."""

    group: PlacementGroup
    node_id: str


def reserve(name: str, need: Mapping[str, float], node: str | None, selector: Mapping[str, str]) -> PlacementGroup | None:
    """A group of one bundle of `need` (`ScalingConfig.worker_resources()`: no zeros), named `name`, on
    `node` where it has room (a preference: else wherever Ray places it), on a node `selector` allows;
    None for a worker that needs nothing."""
    if not need:
        return None
    return placement_group([dict(need)], strategy="STRICT_PACK", name=name, _soft_target_node_id=node or None,
                           bundle_label_selector=[dict(selector)] if selector else None)


def inside(group: PlacementGroup) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor into the group's bundle (its tasks are not captured: Ray Data's go anywhere)."""
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                            placement_group_capture_child_tasks=False)


def release(group: PlacementGroup | None) -> None:
    """Give the bundle back to the cluster (an actor still inside it is ended by Ray)."""
    if group is None:
        return
    try:
        remove_placement_group(group)
    except Exception as exc:  # noqa: BLE001 - removed already (a restarted supervisor's duplicate call)
        logger.debug("placement group %s not removed: %r", group.id.hex(), exc)


def adopt(prefix: str) -> dict[str, Found]:
    """The run's bundles (groups named with `prefix`) that Ray still keeps, by group id."""
    found = {}
    for group_id, row in placement_group_table().items():
        if row.get("name", "").startswith(prefix) and row.get("state") != "REMOVED":
            nodes = [n for n in (row.get("bundles_to_node_id") or {}).values() if n]
            found[group_id] = Found(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))),
                                    nodes[0] if nodes else "")
    return found


def assign(groups: Mapping[str, str], workers: list[tuple[str, str]]) -> list[str | None]:
    """Which of the run's `groups` (group id -> node) each adopted worker (the group it runs in, its
    node) holds: the group it runs in, else one on its node that no worker runs in (a spare took it
    over); None where neither is left."""
    left = dict(groups)
    held: list[str | None] = [own if left.pop(own, None) is not None else None for own, _ in workers]
    for i, (_, node) in enumerate(workers):
        if held[i] is None:
            held[i] = next((g for g in sorted(left) if left[g] == node), None)
            left.pop(held[i] or "", None)
    return held


def name_of(prefix: str, worker_id: int) -> str:
    """The name of the group first reserved for worker `worker_id` (a spare may hold it later)."""
    return f"{prefix}{worker_id}:bundle"
