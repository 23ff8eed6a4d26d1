"""The run's supervisor as a Ray actor: started by `fit()` under a name its run gives it, on the head
node, restarted by Ray when it dies; and found again by that name from any process connected to the
cluster (`attach`: the CLI's status, chaos, the demo)."""

from __future__ import annotations

from typing import Any

import ray

from elastic_train.config import FailureConfig, ScalingConfig
from elastic_train.supervisor.actor import Supervisor
from elastic_train.supervisor.adoption import ACTOR_NAMESPACE
from elastic_train.worker.actor import WorkerSpec

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
