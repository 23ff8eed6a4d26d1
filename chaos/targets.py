"""Which workers a fault hits, found from outside the job.

A harness attaches to a running job with `ray.init(address=...)` and to its run through the
supervisor's Ray actor name (`elastic_train:<run name>`); the supervisor's `status()` lists the
members with rank, pid, node and worker id. A target spec picks among them:

    random        one member, drawn from the harness's seeded generator
    rank:N        the member with rank N (rank0 is rank:0)
    ranks:A,B     several members at once
    node:ID       every member on the node with that Ray node id (prefix is enough)
    node-of-rank0 every member on the node that holds rank 0
    all-but-one   every member but rank 0 (several workers at once)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import ray

from elastic_train.driver.launch import attach


@dataclass(frozen=True)
class Member:
    worker_id: int
    rank: int
    pid: int
    node: str


class RunHandle:
    """A running elastic_train run, attached by name."""

    def __init__(self, run_name: str):
        self.name = run_name
        self.supervisor = attach(run_name)

    def status(self) -> dict[str, Any]:
        return ray.get(self.supervisor.status.remote())

    def members(self) -> list[Member]:
        members = self.status()["members"]
        return sorted((Member(int(wid), m["rank"], m["pid"], m["node"]) for wid, m in members.items()
                       if m["status"] == "TRAINING" and m["pid"]), key=lambda m: m.rank)

    def actor(self, member: Member) -> Any:
        return ray.get(self.supervisor.worker_actor.remote(member.worker_id))


def pick(spec: str, members: list[Member], rng: random.Random) -> list[Member]:
    """The members that target `spec` names (see the module docstring)."""
    if not members:
        return []
    kind, _, arg = spec.partition(":")
    if kind == "random":
        return [rng.choice(members)]
    if kind in ("rank0", "rank"):
        rank = 0 if kind == "rank0" else int(arg)
        return [m for m in members if m.rank == rank]
    if kind == "ranks":
        wanted = {int(r) for r in arg.split(",")}
        return [m for m in members if m.rank in wanted]
    if kind == "node":
        return [m for m in members if m.node.startswith(arg)]
    if kind == "node-of-rank0":
        node = next((m.node for m in members if m.rank == 0), None)
        return [m for m in members if m.node == node]
    if kind == "all-but-one":
        return [m for m in members if m.rank != 0]
    raise ValueError(
        f"unknown target {spec!r}: use random, rank:N, rank0, ranks:A,B, node:ID, node-of-rank0 or all-but-one"
    )
