"""An epoch's execution that gives the same order each time it runs: what lets a restarted coordinator
(or one that let rows go) serve an epoch again without a row twice or skipped.

Ray Data orders blocks by their place with `preserve_order` (ingest/config.py sets it), and seeds
each random operator from its seed and the context's execution index (a count of the executions
that succeeded). So here: every execution of epoch e runs at index e, whatever ran before; and a
`random_shuffle()` / `randomize_block_order()` / `random_sample()` given no seed gets the run's
seed (from its name: a restored run keeps it): each epoch still shuffles anew (Ray's reseeding by execution index), the same way
whenever it is replayed. Randomness of one's own (a UDF's, `read_*(shuffle="files")` unseeded) is
not reached: seed it.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Iterator

logger = logging.getLogger(__name__)


def _operators(dataset: Any) -> Iterator[Any]:
    """The operators of the dataset's logical plan (Ray's private structure: none where it differs)."""
    plan = getattr(dataset, "_logical_plan", None)
    stack, seen = [plan.dag] if plan is not None and hasattr(plan, "dag") else [], set()
    while stack:
        op = stack.pop()
        if id(op) not in seen:
            seen.add(id(op))
            yield op
            stack.extend(getattr(op, "input_dependencies", ()) or ())


def run_seed(run_name: str, dataset: str) -> int:
    """The seed of a run's dataset: the same for the run's life, and for a run restored under its name."""
    return zlib.crc32(f"{run_name}/{dataset}".encode())


def seed_random_operators(dataset: Any, name: str, seed: int) -> None:
    """Give the dataset's unseeded random operators `seed` (in this process's copy of the dataset)."""
    try:
        from ray.data._internal.random_config import RandomSeedConfig
    except ImportError:  # a Ray without seed configs: nothing to reach
        return
    for op in _operators(dataset):
        config = getattr(op, "seed_config", None)
        if isinstance(config, RandomSeedConfig) and config.seed is None:
            object.__setattr__(op, "seed_config", RandomSeedConfig(seed=seed))
            logger.info("dataset %r: %s without a seed takes the run's (%d), so that an epoch replays alike",
                        name, type(op).__name__, seed)


def run_at(dataset: Any, index: int) -> None:
    """The dataset's next execution runs at `index` (its random operators seeded by it)."""
    if hasattr(dataset.context, "_execution_idx"):
        dataset.context._execution_idx = index


__all__ = ["run_at", "run_seed", "seed_random_operators"]
