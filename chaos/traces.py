"""Real spot-instance traces, read and fitted to a test machine.

Two formats (see ../shared/traces/README.md): Oobleck's node events, `time_ms,add|remove,nodeN`;
Bamboo's instance counts, `seconds,count` (a step function; each change appears as two rows at the
same second). Both become a list of node `add`/`remove` events. Traces span hours: `compress`
maps trace time onto test time (e.g. 360 means one trace hour replays in 10 s), and `max_nodes`
caps the cluster at what the machine can host (events beyond the cap are dropped, and the nodes
that are dropped are remembered, so their removals are dropped too).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceEvent:
    at_s: float  # seconds from the trace's start, compressed
    action: str  # "add" | "remove"
    node: str


def read_trace(path: str | Path, compress: float = 1.0, max_nodes: int | None = None,
               start_nodes: int = 0) -> list[TraceEvent]:
    """Node events of an Oobleck or Bamboo trace file, `compress` times faster, at most `max_nodes`
    nodes alive at once (counting `start_nodes` that exist before the trace begins)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("#")]
    raw = _oobleck(rows) if len(rows[0]) == 3 else _bamboo(rows)
    t0 = raw[0].at_s if raw else 0.0
    alive, dropped, out = start_nodes, set(), []
    for e in raw:
        if e.action == "add":
            if max_nodes is not None and alive >= max_nodes:
                dropped.add(e.node)
                continue
            alive += 1
        else:
            if e.node in dropped:
                dropped.discard(e.node)
                continue
            alive -= 1
        out.append(TraceEvent(round((e.at_s - t0) / compress, 3), e.action, e.node))
    return out


def _oobleck(rows: list[list[str]]) -> list[TraceEvent]:
    return [TraceEvent(int(ms) / 1000.0, action.strip(), node.strip()) for ms, action, node in rows]


def _bamboo(rows: list[list[str]]) -> list[TraceEvent]:
    """Instance counts to events: nodes are named by their slot, the newest removed first."""
    events, count = [], 0
    for seconds, value in rows:
        target = int(float(value))
        while count < target:
            count += 1
            events.append(TraceEvent(float(seconds), "add", f"node{count}"))
        while count > target:
            events.append(TraceEvent(float(seconds), "remove", f"node{count}"))
            count -= 1
    return events
