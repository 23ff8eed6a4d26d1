"""What a per-step agreement costs a DDP loop, with no elastic runtime at all.

Why: `report()` is a barrier (as in Ray Train): every report all-reduces a few flags over the loop's
own group (elastic_train/worker/report/barrier.py), issued as the report returns and awaited at the
next one. goodput_sweep's ceiling is the loop's own step over the time each step really takes; this
measures how much of that a barrier alone takes on this machine, whatever the library around it does.

What: two processes on gloo (one thread each, as Ray's 1-CPU workers), the benchmarks' DDP model and
step (`--step-time` of simulated compute), `--steps` steps, in four variants one after the other: no
agreement; one 8-element all-reduce per step issued after the step and awaited before the next one's
(`pipelined`, what a plain report does); the same over a gloo group of its own (`own group`: its
sockets and threads apart from the gradients'); awaited at once (`waited`, what a report that decides
does). Per variant, rank 0's: the mean time a step really takes (the loop's wall time over
its steps, past the first 20); its median step, start to end; and their ratio, the goodput such a loop
reaches without a single fault (what goodput_sweep counts as useful is the median step).

    python -m benchmarks.barrier_cost --out /tmp/bench_barrier
    python -m benchmarks.barrier_cost --quick --out /tmp/bench_barrier
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import BATCH, TABLE, WIDTH, build_model, free_port, machine_facts, train_step

VARIANTS = ("none", "pipelined", "own group", "waited")
WARMUP = 20  # steps not counted: the first ones pay for threads, allocations and caches


def _loop(rank: int, port: int, variant: str, steps: int, step_time: float, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, optimizer = build_model()
    ddp = DistributedDataParallel(model)
    table = torch.randn(TABLE, WIDTH, generator=torch.Generator().manual_seed(0))
    barrier_group = dist.new_group(backend="gloo") if variant == "own group" else None
    pending: dist.Work | None = None
    durations, began_counting = [], 0.0
    for step in range(steps):
        if step == WARMUP:
            began_counting = time.perf_counter()
        ids = (torch.arange(BATCH) + (step * 2 + rank) * BATCH) % TABLE
        began = time.perf_counter()
        train_step(ddp, optimizer, table[ids], step_time)
        durations.append(time.perf_counter() - began)
        if variant != "none":
            if pending is not None:
                pending.wait()
            pending = dist.all_reduce(torch.zeros(8, dtype=torch.int64), async_op=True, group=barrier_group)
            if variant == "waited":
                pending.wait()
    if pending is not None:
        pending.wait()
    counted = steps - WARMUP
    mean_step = (time.perf_counter() - began_counting) / counted
    median = statistics.median(durations[WARMUP:])
    if rank == 0:
        Path(out).write_text(json.dumps({"variant": variant, "steps": counted, "mean_step_ms": round(mean_step * 1e3, 3),
                                         "median_step_ms": round(median * 1e3, 3),
                                         "goodput_ceiling": round(median / mean_step, 4)}))
    dist.destroy_process_group()


def table(report: dict[str, Any]) -> str:
    """The report's markdown table."""
    rows = ["| agreement per step | mean step | median step | goodput ceiling |", "| --- | --- | --- | --- |"]
    rows += [f"| {r['variant']} | {r['mean_step_ms']} ms | {r['median_step_ms']} ms | {r['goodput_ceiling']} |"
             for r in report["rows"]]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="200 steps a variant")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--out", type=Path, default=Path("results") / "barrier_cost")
    args = parser.parse_args()
    steps = 200 if args.quick else args.steps
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in VARIANTS:
        result = args.out / f"{variant.replace(' ', '_')}.json"
        mp.spawn(_loop, args=(free_port(), variant, steps, args.step_time, str(result)), nprocs=2)
        rows.append(json.loads(result.read_text()))
    report = {"benchmark": "barrier_cost", "step_time_s": args.step_time, "machine": machine_facts(), "rows": rows}
    (args.out / "barrier_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


if __name__ == "__main__":
    main()
