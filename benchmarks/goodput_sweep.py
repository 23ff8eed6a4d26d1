"""Goodput against the failure interval, elastic_train next to Ray Train and torchft.

Why: a recovery that costs seconds matters little when machines fail once an hour and dominates
when they fail every few seconds. Sweeping the interval between failures shows where each system's
goodput (the compute time of the steps that count over wall time) falls off.

What: the workload and the measurements of `benchmarks/preemption.py`, under a fixed schedule of
`--faults` SIGKILLs of a random worker, one every T seconds, for each T of `--intervals`; every
system runs the same schedule, one after the other (torchft with its DDP comm hook patched: see
`benchmarks.torchft_system`). Beside goodput, "back at full size": from a kill to the first step
completed by every worker again (elastic_train's warm spare stands in the CPU `--room` leaves); and
"between steps": rank 0's time from a step's end to the next one's start, fault-free at full size
(the loop's own save, the report, the next batch), median and mean; it bounds goodput from above at
step / (step + it).

    python -m benchmarks.goodput_sweep --quick --out /tmp/bench_goodput
    python -m benchmarks.goodput_sweep --intervals 10,30,60 --faults 4 --out results/goodput_sweep
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (add_checkpoint_options, add_room_option, add_systems_option, chosen_checkpointing,
                               chosen_systems, machine_facts)
from benchmarks.preemption import ROOT, SYSTEMS, Fault, run

logger = logging.getLogger("benchmarks.goodput_sweep")


def table(report: dict[str, Any]) -> str:
    """The report's markdown table."""
    rows = ["| failure interval | system | goodput | resume median | back at full size, median | steps redone "
            "| between steps, median / mean |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for p in report["points"]:
        rows.append(f"| {p['interval_s']:g} s | {p['system']} | {p['goodput']:.3f} | {p['resume_s_median']} s "
                    f"| {p['full_size_s_median']} s | {p['steps_redone_total']} "
                    f"| {p['between_steps_ms_median']} / {p['between_steps_ms_mean']} ms |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="intervals 10 and 30 s, 2 faults each")
    parser.add_argument("--intervals", default="10,30,60", help="comma-separated seconds between failures")
    parser.add_argument("--faults", type=int, default=4, help="failures per interval")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--ray-poll-s", type=float, default=0.1, help="Ray Train's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    parser.add_argument("--seed", type=int, default=1)
    add_systems_option(parser, SYSTEMS)
    add_checkpoint_options(parser)
    add_room_option(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "goodput_sweep")
    args = parser.parse_args()
    systems = chosen_systems(parser, args, SYSTEMS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    intervals, count = ([10.0, 30.0], 2) if args.quick else ([float(x) for x in args.intervals.split(",")], args.faults)
    out = args.out.resolve()
    checkpointing = chosen_checkpointing(args)
    started = time.monotonic()
    points = []
    for interval in intervals:
        faults = [Fault(interval * (i + 1), "fixed") for i in range(count)]
        steps = int((faults[-1].at_s + interval) / args.step_time)
        folder = out / f"interval_{interval:g}s"
        folder.mkdir(parents=True, exist_ok=True)
        report = run(systems, faults, steps, args.step_time, args.ray_poll_s, args.seed, folder,
                     {"interval_s": interval, "steps": steps, "step_time_s": args.step_time}, label="run",
                     with_plot=False, checkpointing=checkpointing, room=args.room)
        for s in report["systems"]:
            points.append({"interval_s": interval, "system": s["system"], "goodput": s["goodput"],
                           "resume_s_median": s["resume_s_median"], "full_size_s_median": s["full_size_s_median"],
                           "steps_redone_total": s["steps_redone_total"],
                           "between_steps_ms_median": s["between_steps_ms_median"],
                           "between_steps_ms_mean": s["between_steps_ms_mean"],
                           "faults": s["faults"]})
    summary = {"benchmark": "goodput_sweep", "faults_per_interval": count, "step_time_s": args.step_time,
               "checkpointing": checkpointing.describe(), "room_cpus": args.room,
               "ray_train_health_check_interval_s": args.ray_poll_s, "machine": machine_facts(),
               "total_wall_s": round(time.monotonic() - started, 2), "points": points}
    (out / "goodput_sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{checkpointing.describe()}; torchft keeps none\n" + table(summary))
    print(f"\ntotal {summary['total_wall_s']:.1f} s; {out / 'goodput_sweep.json'}")


if __name__ == "__main__":
    main()
