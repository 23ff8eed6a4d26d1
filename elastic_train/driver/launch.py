"""The run's actors: its supervisor, started by `fit()` under a name its run gives it, on the head
node, restarted by Ray when it dies, and found again by that name from any process connected to the
cluster (`attach`: the CLI's status, chaos, the demo); and a coordinator for each dataset split
across the ranks (ingest/coordinator.py), likewise."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import ray

from elastic_train.config import FailureConfig, ScalingConfig
from elastic_train.run_spec import WorkerSpec
from elastic_train.supervisor.actor import Supervisor
from elastic_train.supervisor.adoption import ACTOR_NAMESPACE

if TYPE_CHECKING:
    from elastic_train.ingest.config import DatasetSource

HEAD_NODE_RESOURCE = "node:__internal_head__"


def on_head_node() -> dict[str, float]:
    """Ray resources that place the supervisor on the head node, which the cluster cannot lose without
    losing itself: it then never goes down with a worker node (the driver's own node may be one)."""
    has_head = any(n["Alive"] and HEAD_NODE_RESOURCE in n["Resources"] for n in ray.nodes())
    return {HEAD_NODE_RESOURCE: 0.001} if has_head else {}


def supervisor_name(run_name: str) -> str:
    """The Ray actor name of a run's supervisor (in the namespace `ACTOR_NAMESPACE`)."""
    return f"elastic_train:{run_name}"


def attach(run_name: str) -> Any:
    """The live supervisor of the run named `run_name`, from any process connected to its Ray cluster
    (raises ValueError when no such run is live)."""
    return ray.get_actor(supervisor_name(run_name), namespace=ACTOR_NAMESPACE)


def start_supervisor(run_name: str, spec: WorkerSpec, scaling: ScalingConfig, failure: FailureConfig) -> Any:
    """Start the supervisor of the run named `run_name`; returns its actor handle."""
    return ray.remote(Supervisor).options(
        name=supervisor_name(run_name), namespace=ACTOR_NAMESPACE, num_cpus=0, max_concurrency=10_000,
        resources=on_head_node(),
        # Ray restarts a dead supervisor, and re-sends the calls it had in flight (this one's too).
        max_restarts=spec.elastic.supervisor_max_restarts, max_task_retries=-1,
        # Never in the caller's placement group (a Tune trial's bundle holds only its driver): the
        # supervisor places the workers itself.
        scheduling_strategy="DEFAULT",
    ).remote(spec, scaling, failure, spec.checkpointing)


def coordinator_name(run_name: str, dataset: str) -> str:
    """The Ray actor name of the coordinator of a run's dataset (in the namespace `ACTOR_NAMESPACE`)."""
    return f"elastic_train:{run_name}:dataset:{dataset}"


def start_coordinators(run_name: str, sources: dict[str, DatasetSource]) -> dict[str, DatasetSource]:
    """`sources` with a coordinator started for each dataset split across the ranks: on the head node
    like the supervisor, restarted by Ray when it dies (it is rebuilt from the ranks' cursors)."""
    from elastic_train.ingest.coordinator import DatasetCoordinator
    from elastic_train.ingest.replay import run_seed

    actor = ray.remote(DatasetCoordinator)
    return {name: dataclasses.replace(source, coordinator=actor.options(
        name=coordinator_name(run_name, name), namespace=ACTOR_NAMESPACE, num_cpus=0, resources=on_head_node(),
        max_restarts=-1, max_task_retries=-1, scheduling_strategy="DEFAULT").remote(
            source.dataset, name, run_seed(run_name, name)))
        if source.split else source for name, source in sources.items()}


def stop_coordinators(sources: dict[str, DatasetSource]) -> None:
    for source in sources.values():
        if source.coordinator is not None:
            ray.kill(source.coordinator)
