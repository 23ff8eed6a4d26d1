"""Kill -> next completed step, side by side: elastic_train's in-place recovery against Ray Train's
restart and torchft's quorum-per-step (`benchmarks.torchft_system`: its own setup, live-state healing,
no checkpoint in the loop; its DDP comm hook patched, see there).

Why: elastic_train's claim is that losing a worker costs a fraction of a second (the survivors keep
their process and resume from a checkpoint held in memory) where Ray Train tears the whole worker
group down and restarts it from storage. This measures both on the same training loop, in one run,
one system after the other (this machine is noisy: compare the two columns, not runs of different days).

What: one loop, written once and parameterized by the API module it calls (`elastic_train` or
`ray.train`): 2 workers, a small DDP model, a fixed step time, and a checkpoint every step (rank 0
saves model + optimizer + step into a temporary directory and reports `Checkpoint.from_directory`,
the other rank reports none: Ray Train's recommended pattern). It resumes from `get_checkpoint()` (torchft: from a live peer's state).
`--checkpoint-every 0` reports no checkpoint at all: elastic_train keeps the model and optimizer live
(`prepare_model(model, live_state=True)`), Ray Train starts over from step 1.
`--framework lightning|transformers` runs the same workload as a PyTorch Lightning or a Hugging Face
Transformers loop instead (`benchmarks.lightning_loop`, `benchmarks.transformers_loop`), written the
way each system's guide for that framework has it, reporting a checkpoint every step.
Rank 1 SIGKILLs its own process every `--kill-every` steps, each kill once (an O_EXCL marker file
records its time, so a restarted loop does not kill again; a kill whose step rank 1 did not run,
because elastic_train was still running on one worker, happens at the next step rank 1 runs). Each
rank logs every completed step, before `report()`. Per kill:

* `resume_s`: the kill to the first step any rank completes after it. A survivor finishing the
  step it was already in when the kill came does not count: it is not a recovery.
* `full_size_s`: the kill to the first step completed by 2 workers again (elastic_train goes on
  with 1 and grows back once a new worker is ready: at once where its warm spare stood by, in the CPU
  `--room` leaves it; Ray Train restarts with 2).
* `grow_pause_s`: the survivors' longest pause when the group grows back: the time from the end of a
  survivor's last step at 1 worker to the end of its first step at 2, less a normal step (rank 0's
  median). Wherever the system makes it wait (elastic_train between steps, torchft inside the step,
  in its quorum), it shows. Ray Train restarts every worker instead: no survivors, no figure.
* `steps_redone`: the steps rank 0 completed a second time after this kill (and before the next).

Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default)
and takes one report per worker per poll, so reporting every step caps its steps at one per poll;
`--ray-poll-s` sets that interval (for Ray Train only).

    python -m benchmarks.kill_recovery --kills 10 --out results/kill_recovery
    python -m benchmarks.kill_recovery --quick --checkpoint-every 0 --systems elastic_train,torchft
    python -m benchmarks.kill_recovery --quick --checkpoint-every 0 --width 2048   # 128 MB of state to restore
    python -m benchmarks.kill_recovery --framework lightning --quick
    python -m benchmarks.kill_recovery --parallel fsdp --quick --checkpoint-every 0   # re-shard from memory
    python -m benchmarks.kill_recovery --data ray --step-time 0.05 --systems elastic_train,ray_train

`--data ray` feeds the torch loop from Ray Data (`TorchTrainer(datasets={"train": ray.data.range(n)})`,
`get_dataset_shard("train").iter_torch_batches`) on both systems, with two CPUs more for Ray Data's
tasks, and adds per kill the wait for the first batch after it (`first_batch_s`), the median wait for
a batch (`fetch_s_median`: the coordinator's cost, and Ray's split's), and the rows trained twice or
skipped in all (a restarted Ray Train walks its epoch from its first row again).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import ray
import ray.data
import ray.train
from ray.train.torch import TorchTrainer as RayTorchTrainer

import elastic_train as et
from benchmarks import torchft_system
from benchmarks.fsdp_loop import FSDP_WIDTH
from benchmarks.common import (Checkpointing, add_checkpoint_options, add_systems_option, chosen_checkpointing,
                               chosen_systems, dataset_rows, machine_facts, median_spread, reported_step, spread, start_ray,
                               WIDTH, add_room_option)
from elastic_train.torch import TorchTrainer as ElasticTorchTrainer

logger = logging.getLogger("benchmarks.kill_recovery")

ROOT = Path(__file__).resolve().parents[1]
NUM_WORKERS = 2
SYSTEMS = ("elastic_train", "ray_train", "torchft")
API = {"elastic_train": "elastic_train", "ray_train": "ray.train"}
# The module whose train_loop(config) runs the workload, per framework.
FRAMEWORKS = {"torch": "benchmarks.common", "lightning": "benchmarks.lightning_loop",
              "transformers": "benchmarks.transformers_loop", "fsdp": "benchmarks.fsdp_loop"}


def run_system(system: str, framework: str, kills: int, kill_every: int, step_time: float,
               ray_poll_s: float | None, out: Path, checkpointing: Checkpointing = Checkpointing(),
               width: int = WIDTH, fixed: bool = False, workers: int = NUM_WORKERS, data: str = "torch",
               room: int = 1) -> dict[str, Any]:
    """Run `framework`'s loop under `system` on a fresh Ray instance with `room` CPUs beyond what the
    workers (and Ray Data) take; returns its measurements."""
    train_loop = importlib.import_module(FRAMEWORKS[framework]).train_loop
    workdir = out / system
    shutil.rmtree(workdir, ignore_errors=True)
    log = workdir / "log"
    log.mkdir(parents=True)
    config = {"api": API.get(system), "log_dir": str(log), "kills": kills, "kill_every": kill_every,
              "steps": kill_every * (kills + 1), "step_time": step_time, "width": width, "data": data,
              **checkpointing.loop_config()}
    env = {"PYTHONPATH": str(ROOT)}
    if system == "ray_train" and ray_poll_s is not None:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(ray_poll_s)
    storage, name = str(workdir / "storage"), "kill_recovery"
    for_data = 2 if data == "ray" else 0  # Ray Data's tasks: CPUs the workers leave
    start_ray(workers + for_data + room, env)
    datasets = {"train": ray.data.range(dataset_rows(config, workers))} if data == "ray" else None
    try:
        started = time.monotonic()
        if system == "torchft":
            facts = torchft_system.run(config, workers, workdir)
            return {"system": system, "wall_s": round(time.monotonic() - started, 2), **facts, **measure(log, workers)}
        if system == "ray_train":
            result = RayTorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=ray.train.ScalingConfig(num_workers=workers), datasets=datasets,
                run_config=ray.train.RunConfig(storage_path=storage, name=name,
                                               failure_config=ray.train.FailureConfig(max_failures=kills + 2)),
            ).fit()
        else:
            result = ElasticTorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=et.ScalingConfig(num_workers=workers if fixed else (1, workers)), datasets=datasets,
                run_config=et.RunConfig(storage_path=storage, name=name,
                                        failure_config=et.FailureConfig(max_failures=kills + 2),
                                        checkpoint_config=checkpointing.elastic_config(),
                                        elastic_config=checkpointing.elastic_runtime()),
            ).fit()
        wall = time.monotonic() - started
    finally:
        ray.shutdown()
    return {"system": system, "wall_s": round(wall, 2), "final_step": reported_step(result), **measure(log, workers)}


def measure(log: Path, workers: int = NUM_WORKERS) -> dict[str, Any]:
    """Per kill: the time to the next step and back to full size, and the steps rank 0 redid."""
    progress = sorted((json.loads(line) for line in (log / "progress.jsonl").read_text().splitlines()),
                      key=lambda r: r["time"])
    kill_records = sorted((json.loads(p.read_text()) for p in log.glob("kill_*.json")), key=lambda k: k["time"])
    ends = [k["time"] for k in kill_records[1:]] + [float("inf")]
    rank0 = [r for r in progress if r["rank"] == 0]
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(rank0, rank0[1:]) if b["step"] == a["step"] + 1)
    resume: list[float | None] = []
    full_size: list[float | None] = []
    grow_pause: list[float | None] = []
    for kill, end in zip(kill_records, ends):
        old_pids = {r["pid"] for r in progress if r["time"] < kill["time"]}
        after = [r for r in progress if kill["time"] < r["time"] < end
                 and not (r["pid"] in old_pids and r["step"] < kill["step"])]
        resume.append(round(after[0]["time"] - kill["time"], 3) if after else None)
        full = next((r for r in after if r["world_size"] == workers), None)
        full_size.append(round(full["time"] - kill["time"], 3) if full else None)
        pauses = []
        for pid in old_pids:
            steps = [r for r in progress if r["pid"] == pid and r["time"] < end]
            grown = next((i for i, r in enumerate(steps) if i and r["world_size"] == workers
                          and steps[i - 1]["world_size"] < workers and r["time"] > kill["time"]), None)
            if grown is not None:
                pauses.append(steps[grown]["time"] - steps[grown - 1]["time"] - step_s)
        grow_pause.append(round(max(pauses), 3) if pauses else None)
    redone = [0] * len(kill_records)
    seen: set[int] = set()
    for r in rank0:
        if r["step"] in seen:
            redone[max(i for i, k in enumerate(kill_records) if k["time"] < r["time"])] += 1
        seen.add(r["step"])
    return {
        "kills": len(kill_records),
        "kill_steps": [k["step"] for k in kill_records],
        **spread("resume_s", resume),
        **spread("full_size_s", full_size),
        **spread("grow_pause_s", grow_pause),
        "steps_redone": redone,
        "steps_redone_median": statistics.median(redone),
        "steps_redone_total": sum(redone),
        "step_s_median": round(step_s, 3),
        "rank0_steps_by_world_size": dict(sorted(Counter(r["world_size"] for r in rank0).items())),
        **_sharded_costs(progress, kill_records),
        **_data_costs(progress, kill_records),
    }


def _data_costs(progress: list[dict[str, Any]], kills: list[dict[str, Any]]) -> dict[str, Any]:
    """With `--data ray`: per kill, the wait for the first batch drawn in the group it left (a survivor's
    at the new size, or a restarted worker's); the median wait for a batch otherwise; and the rows
    trained twice, and skipped, over every step completed."""
    if not any("fetch_s" in r for r in progress):
        return {}
    first = []
    for kill in kills:
        before = [r for r in progress if r["time"] < kill["time"]]
        pids, world = {r["pid"] for r in before}, before[-1]["world_size"] if before else None
        first.append(next((r for r in progress if r["time"] > kill["time"]
                           and (r["pid"] not in pids or r["drawn_world"] != world)), None))
    firsts = {id(r) for r in first if r is not None}
    rows = [i for r in progress for i in r["ids"]]
    return {**spread("first_batch_s", [round(r["fetch_s"], 4) if r else None for r in first]),
            "fetch_s_median": round(statistics.median(r["fetch_s"] for r in progress if id(r) not in firsts), 5),
            "rows_trained_twice": len(rows) - len(set(rows)),
            "rows_skipped": max(rows) + 1 - len(set(rows))}


def _sharded_costs(progress: list[dict[str, Any]], kills: list[dict[str, Any]]) -> dict[str, Any]:
    """The FSDP loop's own timings (benchmarks.fsdp_loop): per kill, the time to the end of the first
    step begun after it (`resume_s` waits for the killed step, so it counts the steps redone) and the
    longest time a rank of the next generation took from entering the loop to a sharded model
    restored; and the median report."""
    if not any("report_s" in r for r in progress):
        return {}
    prepared, first_step = [], []
    for kill in kills:
        after = [r["time"] for r in progress if r["start"] > kill["time"]]
        first_step.append(round(min(after) - kill["time"], 3) if after else None)
        first = [r for r in progress if "prepared_s" in r and r["start"] > kill["time"]]
        generation = [r["prepared_s"] for r in first if r["start"] - first[0]["start"] < 1.0] if first else []
        prepared.append(round(max(generation), 3) if generation else None)
    return {**spread("prepared_s", prepared), **spread("first_step_s", first_step),
            "report_s_median": round(statistics.median(r["report_s"] for r in progress if "report_s" in r), 4)}


def table(report: dict[str, Any]) -> str:
    """The report's markdown table."""
    sharded = report.get("framework") == "fsdp"  # the loop's own timings: benchmarks.fsdp_loop
    fed = report.get("data") == "ray"
    extra = (" | kill -> end of the first step begun after it | loop entry -> state restored: median (min-max) "
             "| report |") if sharded else (" | first batch after a kill: median (min-max) | wait for a batch: median "
                                           "(of a step) | rows trained twice | rows skipped |") if fed else " |"
    rows = [f"| system | kills | kill -> next step: median (min-max) | kill -> {report.get('workers', NUM_WORKERS)} "
            "workers again: median (min-max) | survivors' pause when growing: median (min-max) "
            "| steps redone: total (median) | rank-0 steps at world size | step | wall" + extra,
            "| --- " * (12 if sharded else 13 if fed else 9) + "|"]
    for s in report["systems"]:
        sizes = ", ".join(f"{n}: {c}" for n, c in s["rank0_steps_by_world_size"].items())
        costs = (f" | {median_spread(s, 'first_step_s')} | {median_spread(s, 'prepared_s')} "
                 f"| {s['report_s_median'] * 1000:.1f} ms |") if sharded else (
            f" | {median_spread(s, 'first_batch_s')} | {s['fetch_s_median'] * 1000:.2f} ms "
            f"({s['fetch_s_median'] / s['step_s_median']:.1%}) | {s['rows_trained_twice']} | {s['rows_skipped']} |"
        ) if fed else " |"
        rows.append(f"| {s['system']} | {s['kills']} | {median_spread(s, 'resume_s')} "
                    f"| {median_spread(s, 'full_size_s')} | {median_spread(s, 'grow_pause_s')} "
                    f"| {s['steps_redone_total']} ({s['steps_redone_median']:g}) "
                    f"| {sizes} | {s['step_s_median']:.3f} s | {s['wall_s']:.1f} s" + costs)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 kills, to try the benchmark out")
    parser.add_argument("--kill-every", type=int, default=30,
                        help="steps between kills: enough for elastic_train to grow back to 2 workers in between")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="the MLP's width (2048: 128 MB of parameters and momentum for a recovery to restore)")
    parser.add_argument("--ray-poll-s", type=float, default=None,
                        help="Ray Train's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default: Ray's own, 2 s)")
    parser.add_argument("--fixed", action="store_true",
                        help="elastic_train at a fixed size (num_workers=2) rather than num_workers=(1, 2)")
    parser.add_argument("--framework", choices=sorted(set(FRAMEWORKS) - {"fsdp"}), default="torch",
                        help="the loop: raw PyTorch, a Lightning Trainer or a transformers Trainer")
    parser.add_argument("--data", choices=("torch", "ray", "own"), default="torch",
                        help="ray: the torch loop fed from Ray Data (get_dataset_shard) on both systems; torchft is "
                             "not run. own: no loader, each rank draws its own ids by the rank it read once at the top")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="fsdp: the torch loop's model sharded with FSDP2 (benchmarks.fsdp_loop), 3 workers, "
                             f"width {FSDP_WIDTH} (3.2 M parameters), AdamW; torchft is not run (it does not re-shard)")
    add_systems_option(parser, SYSTEMS)
    add_checkpoint_options(parser)
    add_room_option(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for kill_recovery.json and each system's logs and checkpoints "
                             "(default: results/kill_recovery, with _<framework> for a framework other than torch)")
    args = parser.parse_args()
    systems = chosen_systems(parser, args, SYSTEMS)
    workers = NUM_WORKERS
    if args.parallel == "fsdp":
        if args.framework != "torch":
            parser.error("--parallel fsdp runs the torch loop")
        if args.live:
            parser.error("--live reports dict checkpoints: the FSDP loop reports DCP checkpoints or none (--checkpoint-every 0)")
        args.framework, workers = "fsdp", 3
        args.width = FSDP_WIDTH if args.width == WIDTH else args.width
        if "torchft" in systems:
            systems.remove("torchft")
    if args.data != "torch" and (args.framework != "torch" or args.parallel != "ddp"):
        parser.error(f"--data {args.data} runs the torch loop with DDP")
    if args.data == "ray":
        if "torchft" in systems:
            systems.remove("torchft")
    if args.framework != "torch" and "torchft" in systems:
        if args.systems != ",".join(SYSTEMS):
            parser.error("torchft runs the torch loop only: drop it from --systems, or use --framework torch")
        systems.remove("torchft")
    if args.framework not in ("torch", "fsdp") and (args.live or args.checkpoint_every == 0 or args.width != WIDTH):
        parser.error("--live, --checkpoint-every 0 and --width are for the torch loop: Lightning and transformers "
                     "loops build and checkpoint their own model")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kills = 3 if args.quick else args.kills
    suffix = ("" if args.framework == "torch" else f"_{args.framework}") + {"torch": "", "ray": "_ray_data",
                                                                            "own": "_own_data"}[args.data]
    out = (args.out or ROOT / "results" / f"kill_recovery{suffix}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = []
    for system in systems:
        logger.info("%s (%s loop): %d kills, one every %d steps", system, args.framework, kills, args.kill_every)
        results.append(run_system(system, args.framework, kills, args.kill_every, args.step_time, args.ray_poll_s,
                                  out, chosen_checkpointing(args), args.width, args.fixed, workers, args.data,
                                  args.room))
        logger.info("%s: done in %.1f s", system, results[-1]["wall_s"])
    report = {
        "benchmark": "kill_recovery",
        "framework": args.framework,
        "data": args.data,
        "kills": kills,
        "kill_every_steps": args.kill_every,
        "step_time_s": args.step_time,
        "width": args.width,
        "workers": workers,
        "elastic_train_scaling": workers if args.fixed else [1, workers],
        "ray_train_health_check_interval_s": args.ray_poll_s,
        "checkpointing": chosen_checkpointing(args).describe(),
        "room_cpus": args.room,
        "total_wall_s": round(time.monotonic() - started, 2),
        "machine": machine_facts(),
        "systems": results,
    }
    (out / "kill_recovery.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{args.framework} loop\n" + table(report))
    print(f"\ntotal {report['total_wall_s']:.1f} s; {out / 'kill_recovery.json'}")


if __name__ == "__main__":
    main()
