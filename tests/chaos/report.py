"""The table of chaos scenarios: steps redone and recovery per fault, from a pytest run's files.

    pytest tests/chaos --basetemp=/tmp/chaos
    python -m tests.chaos.report /tmp/chaos

`recovery` is fault -> first step of a newer generation (none when the generation goes on, as
after a supervisor restart or a storage outage); `longest gap` is the longest time between two
steps of rank 0 after the fault, up to the next one.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "-"


def table(basetemp: Path) -> str:
    rows = ["| scenario | faults | steps redone | world sizes | recovery (median, max) | longest gap (median, max) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for path in sorted({p.resolve() for p in basetemp.glob("*/log/scenario.json")}):
        f = json.loads(path.read_text())
        name = f.get("scenario") or path.parent.parent.name
        recovery, stall = f.get("recovery_s", []), f.get("stall_s", [])
        rows.append(f"| {name} | {f['faults']} | {f['redone']} | {f['world_sizes']} | "
                    f"{_median(recovery)}, {max(recovery, default=0):.2f} s | {_median(stall)}, {max(stall, default=0):.2f} s |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
