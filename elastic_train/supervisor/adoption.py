"""Finding a run's workers again after Ray restarts its supervisor.

Why: the supervisor holds the run's state in memory. Ray restarts a killed supervisor actor
(`ElasticConfig.supervisor_max_restarts`), but the new instance starts empty. The workers hold
the truth: their generation, rank, last report index and the checkpoint parts in their memory.
So workers are named, detached actors (a non-detached actor dies with the process that created
it, which would take every worker down with the supervisor); the restarted supervisor lists them
by name, asks each to describe itself, and adopts those that answer. Calls the workers had in
flight are retried by Ray on the new instance, and wait until adoption is done.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from elastic_train.protocol import WorkerInfo

logger = logging.getLogger(__name__)


ACTOR_NAMESPACE = "elastic_train"  # the Ray namespace of every run's supervisor and workers: found from any process (`elastic-train status`, chaos); detached actors in a driver's anonymous one make Ray warn


def worker_prefix(supervisor_actor_id: str) -> str:
    """The name prefix of a run's workers: the supervisor's actor id is the same after a restart."""
    return f"elastic_train:{supervisor_actor_id}:worker:"


def worker_name(prefix: str, worker_id: int) -> str:
    return f"{prefix}{worker_id}"


async def describe_workers(prefix: str, timeout_s: float) -> tuple[list[tuple[Any, WorkerInfo]], int]:
    """The run's workers that describe themselves within `timeout_s`, with their handles, and the
    next free worker id. Those that do not answer (still starting, hung) are killed: the supervisor
    starts replacements."""
    loop = asyncio.get_running_loop()
    listed = await loop.run_in_executor(None, lambda: ray.util.list_named_actors(all_namespaces=True))
    names = [a["name"] for a in listed if a["namespace"] == ACTOR_NAMESPACE and a["name"].startswith(prefix)]
    handles = [await loop.run_in_executor(None, ray.get_actor, n, ACTOR_NAMESPACE) for n in names]
    answers = await asyncio.gather(
        *(asyncio.wait_for(h.describe.remote(), timeout_s) for h in handles),
        return_exceptions=True,
    )
    found = []
    for name, handle, answer in zip(names, handles, answers):
        if isinstance(answer, BaseException):
            logger.warning("worker %s did not describe itself (%r); killing it", name, answer)
            ray.kill(handle)
        else:
            found.append((handle, answer))
    next_id = 1 + max((int(n[len(prefix):]) for n in names), default=-1)
    return found, next_id
