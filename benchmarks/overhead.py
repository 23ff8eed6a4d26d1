"""Fault-free throughput: elastic_train and torchft against plain PyTorch DDP on the same model and loop.

Why: elastic_train's recovery is paid for on every step, failure or not: `report()` sends a call to
the supervisor (and settles the previous one), a heartbeat thread runs beside the loop, and with a
checkpoint the report copies its files into memory for a background upload. This measures what
that costs a run that never fails, against the same loop under plain `torch.distributed` DDP with
no Ray at all, side by side in one run (this machine is noisy: compare the ratios of one run).

What: one loop, written once: 2 ranks, a small MLP (4 x Linear(64, 64) + ReLU, batch 32 per rank,
SGD with momentum, one intra-op thread per rank), a fixed simulated compute time per step
(`time.sleep`), run at `--step-time` and at 0 s (the worst case: nothing hides the per-step cost).
Each rank takes a `time.perf_counter()` timestamp as every step starts and after the last one, and
writes them to a file in the run's log folder when the loop ends. Variants:

* `plain_ddp`: 2 processes from `torch.multiprocessing` (spawn), gloo over 127.0.0.1
  (MASTER_ADDR / MASTER_PORT on a free port), `DistributedDataParallel`; no report.
* `plain_ddp+checkpoint`: the same, and rank 0 saves a checkpoint every step as a loop with no
  library would: torch.save of model + optimizer state into a file in the run's folder, under a
  temporary name then renamed (the last one stays whole). What the loop's own saving costs; the
  `elastic_train+checkpoint` rows are to be read against it too.
* `elastic_train`: `TorchTrainer` with `ScalingConfig(num_workers=2)` on a fresh Ray instance,
  `prepare_model`, and `report(metrics)` every step on every rank.
* `elastic_train+reentry`: the same with `ElasticConfig(recover_in_place=False)`: DDP without the
  comm hook and the process group that let a loop go on in place (worker/group/reduction.py,
  worker/group/ddp.py); next to `elastic_train`, what they cost.
* `elastic_train+checkpoint`: the same, and a checkpoint every step: rank 0 torch.saves model +
  optimizer state into a temporary directory and reports `Checkpoint.from_directory`, the other
  rank reports metrics only.
* `elastic_train+checkpoint+nowait`: the same with `ElasticConfig(part_safe_wait_s=0)`: a report
  whose part is copied in the background returns without waiting for it to be copied to its buddy
  or stored (a worker lost within those milliseconds loses that report's part: one more step
  redone). A part of up to 1 MB goes to the buddy inside the report whatever this setting
  (worker/report/part_exchange.py), so at this model's size the two rows measure the same path.
* `elastic_train+checkpoint/10`: the same with rank 0's checkpoint every 10th step; the other
  reports need no answer from the supervisor (they cost one small all-reduce).
* `elastic_train+live/10`: every rank reports its live state every step (`Checkpoint.from_dict` of
  model + optimizer state: held in memory, serialized only when stored or for a recovery), and
  every 10th is stored (`CheckpointConfig(store_every_n_reports=10)`): recovery from the state of
  the last step, at the storage cost of a checkpoint every 10 steps.
* `elastic_train+kept`: no checkpoint at all; `prepare_model(model, live_state=True)` keeps the model
  and optimizer live, so each `report(metrics)` holds their state by reference for a recovery from
  the last step. Nothing is stored.
* `elastic_train+fsdp`, `elastic_train+fsdp+kept`: the MLP at width 896 (3.2 M parameters, AdamW)
  sharded by `prepare_model(parallel_strategy="fsdp")`, without and with its state kept (each report
  copies the rank's share, sent to its buddy in the background: worker/hold/sharded_state.py). Another
  model than the others': compare these two rows with each other.
* `torchft`: torchft 0.2.0 in its recommended setup (`benchmarks.torchft_system`: a Lighthouse, a
  replica group per worker, its DDP and Optimizer wrappers, a quorum every step; its DDP comm hook
  patched for gloo), the same model, batches and compute; no checkpoint (it heals from live peers).
  Its steps' start times are those it logs for each committed step.

Process and worker start-up are outside the timestamps. The first steps are skipped (warm-up).
Per variant, from rank 0's step durations pooled over repeats: the median step time, steps/s
(1 / that median), the ratio to plain DDP's steps/s at the same step time, and the per-step
overhead (median step time minus plain DDP's); and the ratio of mean steps/s, which counts the
steps that checkpoint in a variant that checkpoints one step in ten. Each repeat runs every variant once, the order of
the systems reversed on odd repeats.

    python -m benchmarks.overhead --out results/overhead
    python -m benchmarks.overhead --quick --out /tmp/bench_overhead
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import elastic_train as et
from benchmarks import torchft_system
from benchmarks.common import (WIDTH, add_systems_option, batch, build_model, chosen_systems, free_port,
                               machine_facts, train_step)
from benchmarks.fsdp_loop import FSDP_WIDTH

logger = logging.getLogger("benchmarks.overhead")

ROOT = Path(__file__).resolve().parents[1]
NUM_WORKERS = 2
SKIP_STEPS = 5
BASELINE = "plain_ddp"
CHECKPOINT_EVERY = 10  # the sparse-checkpoint variant's interval (issue 14's target: >= 0.95 of plain DDP)
SYSTEMS = (BASELINE, f"{BASELINE}+checkpoint", "elastic_train", "elastic_train+reentry", "elastic_train+checkpoint", "elastic_train+checkpoint+nowait",
           f"elastic_train+checkpoint/{CHECKPOINT_EVERY}",
           f"elastic_train+live/{CHECKPOINT_EVERY}", "elastic_train+kept", "elastic_train+fsdp", "elastic_train+fsdp+kept",
           "torchft")

Report = Callable[[int, dict[str, float]], None]


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer, identical on every rank and in every variant."""
    torch.set_num_threads(1)  # 2 ranks on 2 cores, whatever OMP_NUM_THREADS the launcher set
    return build_model()


def _run_steps(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, config: dict[str, Any],
               report: Report) -> None:
    """The loop every variant runs; writes this rank's step start times (plus the end) to the log folder."""
    times = []
    for step in range(1, config["steps"] + 1):
        times.append(time.perf_counter())
        loss = train_step(ddp, optimizer, batch(step, rank, config["width"]), config["step_time"])
        report(step, {"loss": loss.item(), "step": step})
    times.append(time.perf_counter())
    (Path(config["log_dir"]) / f"rank{rank}.json").write_text(json.dumps(times))


def ddp_worker(rank: int, port: int, config: dict[str, Any]) -> None:
    """One plain DDP rank (a torch.multiprocessing child): gloo over 127.0.0.1, no Ray."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=NUM_WORKERS)
    try:
        model, optimizer = _build()
        _run_steps(DistributedDataParallel(model), optimizer, rank, config,
                   _plain_save(model, optimizer, Path(config["log_dir"]).parent) if config["checkpoint"] and rank == 0
                   else lambda step, metrics: None)
    finally:
        dist.destroy_process_group()


def elastic_loop(config: dict[str, Any]) -> None:
    """The elastic_train loop: report every step, with rank 0's checkpoint every `config["checkpoint"]`
    steps (0: none), or with every rank's live state (`config["live"]`), or with none and the model
    and optimizer kept live (`config["kept"]`)."""
    rank = et.get_context().get_world_rank()
    if config["fsdp"]:
        torch.set_num_threads(1)
        model, _ = build_model(config["width"])
        model = et.torch.prepare_model(model, parallel_strategy="fsdp", live_state=config["kept"])
        _run_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rank, config, lambda step, m: et.report(m))
        return
    model, optimizer = _build()

    def report(step: int, metrics: dict[str, float]) -> None:
        if config["live"]:
            et.report(metrics, checkpoint=et.Checkpoint.from_dict(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}))
            return
        if not config["checkpoint"] or step % config["checkpoint"] or rank != 0:
            et.report(metrics)
            return
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       Path(d) / "state.pt")
            et.report(metrics, checkpoint=et.Checkpoint.from_directory(d))

    _run_steps(et.torch.prepare_model(model, live_state=config["kept"]), optimizer, rank, config, report)


def _plain_save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> Report:
    """Rank 0's checkpoint in a loop with no library: the state saved whole, every step."""
    def save(step: int, metrics: dict[str, float]) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   folder / "checkpoint.pt.tmp")
        os.replace(folder / "checkpoint.pt.tmp", folder / "checkpoint.pt")

    return save


def run_variant(system: str, steps: int, step_time: float, workdir: Path) -> list[float]:
    """Run `system` once; returns rank 0's step durations after the warm-up steps."""
    shutil.rmtree(workdir, ignore_errors=True)  # a run whose name has checkpoints in storage would resume
    log = workdir / "log"
    log.mkdir(parents=True)
    every = int(system.rpartition("/")[2]) if "/" in system else 1
    config = {"steps": steps, "step_time": step_time, "log_dir": str(log),
              "checkpoint": every if "+checkpoint" in system else 0, "live": "+live" in system,
              "kept": "+kept" in system, "fsdp": "+fsdp" in system, "width": FSDP_WIDTH if "+fsdp" in system else WIDTH}
    if system.startswith(BASELINE):
        mp.spawn(ddp_worker, args=(free_port(), config), nprocs=NUM_WORKERS, join=True)
    else:
        ray.init(num_cpus=NUM_WORKERS, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        try:
            if system == "torchft":
                torchft_system.run(config, NUM_WORKERS, workdir)
            else:
                et.TorchTrainer(
                    elastic_loop, train_loop_config=config,
                    scaling_config=et.ScalingConfig(num_workers=NUM_WORKERS),
                    run_config=et.RunConfig(storage_path=str(workdir / "storage"), name="overhead",
                                            elastic_config=et.ElasticConfig(
                                                recover_in_place="+reentry" not in system,
                                                **({"part_safe_wait_s": 0} if "+nowait" in system else {})),
                                            checkpoint_config=et.CheckpointConfig(
                                                store_every_n_reports=every if config["live"] else None)),
                ).fit()
        finally:
            ray.shutdown()
    if system == "torchft":
        records = (json.loads(line) for line in (log / "progress.jsonl").read_text().splitlines())
        times = sorted(r["start"] for r in records if r["rank"] == 0)
    else:
        times = json.loads((log / "rank0.json").read_text())
    return [b - a for a, b in zip(times, times[1:])][SKIP_STEPS:]


def _summary(system: str, step_time: float, durations: list[list[float]]) -> dict[str, Any]:
    pooled = [d for rep in durations for d in rep]
    median = statistics.median(pooled)
    return {
        "system": system,
        "step_time_s": step_time,
        "steps_measured": len(pooled),
        "step_s_median": round(median, 6),
        "step_s_p90": round(sorted(pooled)[round(0.9 * (len(pooled) - 1))], 6),
        "steps_per_s": round(1 / median, 2),
        "steps_per_s_mean": round(len(pooled) / sum(pooled), 2),
        "step_s_median_per_repeat": [round(statistics.median(rep), 6) for rep in durations],
    }


def table(report: dict[str, Any]) -> str:
    """The report's markdown table."""
    rows = [f"{report['workers']} workers, {report['steps']} steps x {report['repeats']} repeat(s), first "
            f"{report['skipped_first_steps']} skipped; rank 0's steps",
            "",
            "| step time | system | step median | step p90 | steps/s | / plain DDP | / plain DDP (mean steps/s) "
            "| overhead per step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in report["variants"]:
        rows.append(f"| {v['step_time_s'] * 1000:g} ms | {v['system']} | {v['step_s_median'] * 1000:.2f} ms "
                    f"| {v['step_s_p90'] * 1000:.2f} ms | {v['steps_per_s']:.1f} | {v['ratio_to_ddp']:.3f} "
                    f"| {v['ratio_to_ddp_mean']:.3f} | {v['overhead_ms_per_step']:+.2f} ms |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 steps, 1 repeat, to try the benchmark out")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 300; quick 60)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of every variant (default 2; quick 1)")
    parser.add_argument("--step-time", type=float, default=0.05,
                        help="seconds of simulated compute per step (every variant also runs at 0)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "overhead",
                        help="folder for overhead.json and each run's logs and checkpoints")
    add_systems_option(parser, SYSTEMS)
    args = parser.parse_args()
    systems = chosen_systems(parser, args, SYSTEMS)
    if BASELINE not in systems:
        parser.error(f"--systems must include {BASELINE}: every ratio is to it")
    steps = args.steps or (60 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick else 2)
    if steps <= SKIP_STEPS + 1:
        parser.error(f"--steps must be more than {SKIP_STEPS + 1} (the first {SKIP_STEPS} are skipped)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    step_times = sorted({args.step_time, 0.0}, reverse=True)
    started = time.monotonic()
    durations: dict[tuple[str, float], list[list[float]]] = {(s, t): [] for t in step_times for s in systems}
    for rep in range(repeats):
        for step_time in step_times:
            for system in systems if rep % 2 == 0 else systems[::-1]:
                slug = system.replace("+", "_").replace("/", "_every_")
                measured = run_variant(system, steps, step_time, out / f"r{rep}_{slug}_{step_time * 1000:g}ms")
                durations[(system, step_time)].append(measured)
                logger.info("repeat %d/%d, step time %g s, %s: median step %.2f ms", rep + 1, repeats, step_time,
                            system, statistics.median(measured) * 1000)
    variants = []
    for step_time in step_times:
        base = _summary(BASELINE, step_time, durations[(BASELINE, step_time)])
        for system in systems:
            v = _summary(system, step_time, durations[(system, step_time)])
            v["ratio_to_ddp"] = round(v["steps_per_s"] / base["steps_per_s"], 3)
            v["ratio_to_ddp_mean"] = round(v["steps_per_s_mean"] / base["steps_per_s_mean"], 3)
            v["overhead_ms_per_step"] = round((v["step_s_median"] - base["step_s_median"]) * 1000, 3)
            variants.append(v)
    report = {
        "benchmark": "overhead",
        "quick": args.quick,
        "workers": NUM_WORKERS,
        "steps": steps,
        "repeats": repeats,
        "skipped_first_steps": SKIP_STEPS,
        "step_time_s": args.step_time,
        "measured": "rank 0's step durations (start to next start, report included), pooled over repeats; "
                    "steps_per_s = 1 / step_s_median; ratio_to_ddp and overhead_ms_per_step against plain_ddp "
                    "at the same step time; ratio_to_ddp_mean from mean steps/s, which counts the steps "
                    f"that checkpoint (one in {CHECKPOINT_EVERY} in elastic_train+checkpoint/{CHECKPOINT_EVERY}) "
                    f"or store (elastic_train+live/{CHECKPOINT_EVERY})",
        "total_wall_s": round(time.monotonic() - started, 2),
        "machine": machine_facts(),
        "variants": variants,
    }
    (out / "overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(report))
    print(f"\ntotal {report['total_wall_s']:.1f} s; {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
