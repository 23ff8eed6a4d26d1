"""Preemption benchmark: detection, resume time, lost work and goodput, elastic_train next to Ray Train
and torchft.

Why: users pick a fault-tolerance layer on how fast training resumes after a failure, how much
work a failure throws away, and what fraction of wall time is useful training. Ray Train is what
they would use otherwise, torchft the strongest in-place peer, so all three run the same workload
under the same fault schedule, one after the other in one invocation (this machine is noisy: compare
the columns of one run).

Workload: one loop, written once against the API module it is given (`elastic_train` or
`ray.train`): 2 workers, a small DDP model, `--step-time` seconds of simulated compute per step,
and a checkpoint every step (rank 0 saves model + optimizer + step and reports
`Checkpoint.from_directory`; the other rank reports metrics only), resumed from `get_checkpoint()`.
Every rank logs each step's start and end. torchft runs the same model, batches and compute in its
own recommended setup, with no checkpoint in the loop (`benchmarks.torchft_system`: a Lighthouse, a
replica group per worker, healing from a live peer, a killed replica relaunched by Ray; its DDP comm
hook patched, else a SIGKILL kills the survivor on gloo).

Fault schedule (seconds from the first step; the same for both systems), three segments:
  * fixed: a fault every `--interval` seconds;
  * poisson: faults at exponential intervals of mean `--interval` (seeded);
  * trace: the first node removals of a real AWS spot trace (Oobleck's g4dn trace, compressed
    `--compress` times, capped at as many nodes as there are workers), each as the loss of a worker.
A fault SIGKILLs the process of a worker chosen at random (seeded) among those that logged a step
in the last 2 seconds: the machine under it is gone, no notice.

Per fault:
  * detect_s: the kill to the system noticing. elastic_train: the supervisor's `worker_lost` event.
    Ray Train: the surviving worker's process ending (Ray Train tears the group down once its
    controller noticed), an upper bound. torchft: a survivor's step not committed.
  * resume_s: the kill to the first step completed after it (a survivor finishing the step it was
    in when the kill came does not count).
  * steps_redone: steps rank 0 completed again after this fault (work lost).
Per system, goodput: the useful time of the steps that count (each step's last run, rank 0), over the
loop's wall time (first step start to last step end). A step's useful time is the median fault-free
step (rank 0's steps at full size, start to end, without the report): a step that sat out a failure
inside the system (torchft's first step after a kill waits in its quorum for the heartbeat timeout)
counts no more than any other.

Ray Train 2.60's controller polls workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default)
and a report waits for the poll, which alone would cap it at one step per 2 s: it runs with
`--ray-poll-s` (0.1 s by default), in its favour.

    python -m benchmarks.preemption --quick --out /tmp/bench_preemption
    python -m benchmarks.preemption --out results/preemption
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import ray.train
from ray.train.torch import TorchTrainer as RayTorchTrainer

import elastic_train as et
from benchmarks import torchft_system
from benchmarks.common import (
    Checkpointing,
    add_checkpoint_options,
    add_room_option,
    chosen_checkpointing,
    add_systems_option,
    chosen_systems,
    start_ray,
    machine_facts,
    median_spread,
    reported_step,
    spread,
    train_loop,
)
from chaos import schedules
from chaos.traces import read_trace

logger = logging.getLogger("benchmarks.preemption")

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "chaos" / "data" / "oobleck-aws-g4dn-events.csv"
NUM_WORKERS = 2
SYSTEMS = ("elastic_train", "ray_train", "torchft")
API = {"elastic_train": "elastic_train", "ray_train": "ray.train"}
RECENT_S = 2.0  # a fault picks among workers that completed a step this recently


@dataclass
class Fault:
    at_s: float  # planned, from the first step
    segment: str  # fixed | poisson | trace


def fault_schedule(interval_s: float, per_segment: int, compress: float, seed: int, lead_s: float) -> list[Fault]:
    """The three segments one after the other, each `per_segment` faults, `interval_s` apart on average."""
    faults = [Fault(f.at_s, "fixed") for f in schedules.every(interval_s, per_segment, start_s=lead_s)]
    start = faults[-1].at_s + interval_s
    faults += [Fault(f.at_s, "poisson") for f in schedules.poisson(interval_s, per_segment, seed=seed, start_s=start)]
    start = faults[-1].at_s + interval_s
    trace = read_trace(TRACE, compress=compress, max_nodes=NUM_WORKERS)  # as many nodes as this machine hosts
    removals = [e for e in trace if e.action == "remove"][:per_segment]
    faults += [Fault(start + e.at_s - removals[0].at_s, "trace") for e in removals]
    return faults


def read_progress(log: Path) -> list[dict[str, Any]]:
    path = log / "progress.jsonl"
    if not path.exists():
        return []
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda r: r["time"])


class FaultInjector(threading.Thread):
    """SIGKILLs a recently active worker at each planned time, counted from the first logged step,
    and watches the other workers' processes end (Ray Train's teardown, its detection bound)."""

    def __init__(self, log: Path, faults: list[Fault], seed: int):
        super().__init__(name="fault-injector", daemon=True)
        self._log, self._faults, self._rng = log, faults, random.Random(seed)
        self._halt = threading.Event()
        self.injected: list[dict[str, Any]] = []

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not read_progress(self._log):
            if self._halt.wait(0.05):
                return
        t0 = read_progress(self._log)[0]["start"]
        for fault in self._faults:
            if self._halt.wait(max(0.0, t0 + fault.at_s - time.time())):
                return
            recent = [r for r in read_progress(self._log) if r["time"] > time.time() - RECENT_S]
            killed = {f["pid"] for f in self.injected}
            pids = sorted({r["pid"] for r in recent if r["pid"] not in killed and psutil.pid_exists(r["pid"])})
            if not pids:
                logger.info("fault at %.1f s skipped: no worker stepped in the last %.0f s", fault.at_s, RECENT_S)
                continue
            victim = self._rng.choice(pids)
            others = [p for p in pids if p != victim]
            at = time.time()
            os.kill(victim, signal.SIGKILL)
            entry = {**asdict(fault), "time": at, "pid": victim, "others": others}
            self.injected.append(entry)
            logger.info("fault %d (%s) at %.1f s: SIGKILL pid %d", len(self.injected), fault.segment, fault.at_s,
                        victim)
            threading.Thread(target=self._watch_teardown, args=(entry,), daemon=True).start()

    def _watch_teardown(self, entry: dict[str, Any]) -> None:
        """Record when the first other worker process of this fault ends (within 60 s)."""
        deadline = entry["time"] + 60.0
        while time.time() < deadline and not self._halt.is_set():
            if any(not psutil.pid_exists(p) for p in entry["others"]):
                entry["others_ended"] = time.time()
                return
            time.sleep(0.01)


def run_system(system: str, faults: list[Fault], steps: int, step_time: float, ray_poll_s: float, seed: int,
               out: Path, checkpointing: Checkpointing = Checkpointing(), room: int = 1) -> dict[str, Any]:
    """Run the loop under `system` on a fresh Ray instance of the workers' CPUs and `room` more, injecting
    `faults`; returns its measurements."""
    workdir = out / system
    shutil.rmtree(workdir, ignore_errors=True)
    log = workdir / "log"
    log.mkdir(parents=True)
    config = {"api": API.get(system), "log_dir": str(log), "steps": steps, "step_time": step_time,
              **checkpointing.loop_config()}
    env = {"PYTHONPATH": str(ROOT)}
    if system == "ray_train":
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(ray_poll_s)
    storage, name, budget = str(workdir / "storage"), "preemption", len(faults) + 2
    injector = FaultInjector(log, faults, seed)
    start_ray(NUM_WORKERS + room, env)
    try:
        injector.start()
        started = time.monotonic()
        if system == "torchft":
            final_step = torchft_system.run(config, NUM_WORKERS, workdir)["final_step"]
            noticed = torchft_system.uncommitted(log)
        elif system == "ray_train":
            result = RayTorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=ray.train.ScalingConfig(num_workers=NUM_WORKERS),
                run_config=ray.train.RunConfig(storage_path=storage, name=name,
                                               failure_config=ray.train.FailureConfig(max_failures=budget)),
            ).fit()
            final_step, noticed = reported_step(result), None
        else:
            result = et.TorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=et.ScalingConfig(num_workers=(1, NUM_WORKERS)),
                run_config=et.RunConfig(storage_path=storage, name=name,
                                        failure_config=et.FailureConfig(max_failures=budget),
                                        checkpoint_config=checkpointing.elastic_config(),
                                        elastic_config=checkpointing.elastic_runtime()),
            ).fit()
            final_step = reported_step(result)
            noticed = [e["time"] for e in result.events if e["kind"] == "worker_lost"]
        wall = time.monotonic() - started
    finally:
        injector.stop()
        ray.shutdown()
    progress = read_progress(log)
    (workdir / "faults.json").write_text(json.dumps(injector.injected, indent=1))
    return {"system": system, "fit_wall_s": round(wall, 2), "final_step": final_step,
            **measure(progress, injector.injected, noticed)}


def measure(progress: list[dict[str, Any]], faults: list[dict[str, Any]],
            noticed_at: list[float] | None) -> dict[str, Any]:
    """Per fault: detection (the first of `noticed_at` after it; None: when the other workers' processes
    ended), resume, back at full size (the first step completed by every worker again) and steps redone;
    per system: goodput over the loop's wall time."""
    ends = [f["time"] for f in faults[1:]] + [float("inf")]
    detect: list[float | None] = []
    resume: list[float | None] = []
    full_size: list[float | None] = []
    for fault, end in zip(faults, ends):
        if noticed_at is not None:
            noticed = next((t for t in sorted(noticed_at) if t >= fault["time"]), None)
        else:
            noticed = fault.get("others_ended")
        detect.append(round(noticed - fault["time"], 3) if noticed is not None and noticed < end else None)
        in_step = {r["pid"]: r["step"] for r in progress if r["time"] < fault["time"]}
        after = [r for r in progress if fault["time"] < r["time"] < end
                 and not (r["pid"] in in_step and r["start"] < fault["time"])]
        resume.append(round(after[0]["time"] - fault["time"], 3) if after else None)
        back = next((r for r in after if r["world_size"] == NUM_WORKERS), None)
        full_size.append(round(back["time"] - fault["time"], 3) if back else None)
    rank0 = [r for r in progress if r["rank"] == 0]
    redone = [0] * len(faults)
    last_run: dict[int, dict[str, Any]] = {}
    for r in rank0:
        if r["step"] in last_run:
            before = [i for i, f in enumerate(faults) if f["time"] < r["time"]]
            if before:
                redone[before[-1]] += 1
        last_run[r["step"]] = r
    full = [r["time"] - r["start"] for r in rank0 if r["world_size"] == NUM_WORKERS]
    useful = len(last_run) * statistics.median(full)
    # From a step's end to the next one's start in one process at full size: the loop's own save, the
    # report, the next batch. Fault-free, goodput is at most step / (step + this).
    between = [b["start"] - a["time"] for a, b in zip(rank0, rank0[1:])
               if b["step"] == a["step"] + 1 and b["pid"] == a["pid"] and a["world_size"] == b["world_size"] == NUM_WORKERS]
    loop_wall = rank0[-1]["time"] - rank0[0]["start"]
    return {
        "faults": len(faults),
        "segments": [f["segment"] for f in faults],
        **spread("detect_s", detect),
        **spread("resume_s", resume),
        **spread("full_size_s", full_size),
        **spread("steps_redone", redone),
        "steps_redone_total": sum(redone),
        "goodput": round(useful / loop_wall, 3),
        "useful_s": round(useful, 2),
        "loop_wall_s": round(loop_wall, 2),
        "step_compute_s_median": round(statistics.median(full), 4),
        "between_steps_ms_median": round(statistics.median(between) * 1e3, 2) if between else None,
        "between_steps_ms_mean": round(statistics.mean(between) * 1e3, 2) if between else None,
        "per_segment": {
            seg: {"resume_s_median": spread("r", [v for v, f in zip(resume, faults) if f["segment"] == seg])["r_median"],
                  "steps_redone_total": sum(n for n, f in zip(redone, faults) if f["segment"] == seg)}
            for seg in dict.fromkeys(f["segment"] for f in faults)
        },
    }


def plot(results: list[dict[str, Any]], out: Path, bin_s: float = 1.0) -> Path:
    """Step rate over time (rank 0, steps per `bin_s`), world size, and the faults, one panel per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fixed": "tab:red", "poisson": "tab:purple", "trace": "tab:orange"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.2 * len(results)), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        progress, faults = res["_progress"], res["_faults"]
        t0 = progress[0]["start"]
        rank0 = [r for r in progress if r["rank"] == 0]
        horizon = max(r["time"] for r in progress) - t0
        bins = [0] * (int(horizon / bin_s) + 1)
        for r in rank0:
            bins[int((r["time"] - t0) / bin_s)] += 1
        ax.plot([i * bin_s for i in range(len(bins))], [b / bin_s for b in bins], color="tab:blue", lw=1,
                label="steps/s (rank 0)")
        ax.set_ylabel("steps/s")
        world = ax.twinx()
        world.step([r["time"] - t0 for r in rank0], [r["world_size"] for r in rank0], where="post", color="tab:green",
                   lw=1.5, label="world size")
        world.set_ylim(0, NUM_WORKERS + 0.5)
        world.set_ylabel("world size")
        for f in faults:
            ax.axvline(f["time"] - t0, color=colors[f["segment"]], ls="--", lw=1)
        handles = [plt.Line2D([], [], color=c, ls="--", label=f"fault ({s})") for s, c in colors.items()]
        ax.legend(handles=ax.get_legend_handles_labels()[0] + world.get_legend_handles_labels()[0] + handles,
                  loc="lower right", fontsize=8)
        ax.set_title(f"{res['system']}: resume median {res['resume_s_median']} s, "
                     f"{res['steps_redone_total']} steps redone, goodput {res['goodput']}")
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.tight_layout()
    path = out / "preemption.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(systems: list[str], faults: list[Fault], steps: int, step_time: float, ray_poll_s: float, seed: int,
        out: Path, settings: dict[str, Any], label: str = "preemption", with_plot: bool = True,
        checkpointing: Checkpointing = Checkpointing(), room: int = 1) -> dict[str, Any]:
    """Every system under the same schedule; writes `<label>.json` (and the plot) to `out`."""
    started = time.monotonic()
    results = []
    for system in systems:
        logger.info("%s: %d faults, %d steps", system, len(faults), steps)
        res = run_system(system, faults, steps, step_time, ray_poll_s, seed, out, checkpointing, room)
        res["_progress"] = read_progress(out / system / "log")
        res["_faults"] = json.loads((out / system / "faults.json").read_text())
        results.append(res)
    if with_plot:
        plot(results, out)
    report = {
        "benchmark": label,
        **settings,
        "checkpointing": checkpointing.describe(),
        "planned_faults": [asdict(f) for f in faults],
        "total_wall_s": round(time.monotonic() - started, 2),
        "machine": machine_facts(),
        "systems": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
    }
    (out / f"{label}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict[str, Any]) -> str:
    rows = ["| system | faults | detect: median (min-max) | resume: median (min-max) | steps redone: total (median) "
            "| goodput | loop wall |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in report["systems"]:
        rows.append(f"| {s['system']} | {s['faults']} | {median_spread(s, 'detect_s')} | {median_spread(s, 'resume_s')} "
                    f"| {s['steps_redone_total']} ({s['steps_redone_median']:g}) | {s['goodput']:.3f} "
                    f"| {s['loop_wall_s']:.1f} s |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 faults per segment, 20 s apart: a few minutes")
    parser.add_argument("--per-segment", type=int, default=4, help="faults in each of the three segments")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between faults (mean for poisson)")
    parser.add_argument("--compress", type=float, default=360.0, help="how much faster than real time the trace runs")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--ray-poll-s", type=float, default=0.1, help="Ray Train's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")
    parser.add_argument("--seed", type=int, default=1)
    add_systems_option(parser, SYSTEMS)
    add_checkpoint_options(parser)
    add_room_option(parser)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "preemption")
    args = parser.parse_args()
    systems = chosen_systems(parser, args, SYSTEMS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    per_segment, interval = (2, 20.0) if args.quick else (args.per_segment, args.interval)
    faults = fault_schedule(interval, per_segment, args.compress, args.seed, lead_s=interval / 2)
    # Enough steps for the fastest system to run past the last fault by one interval.
    steps = int((faults[-1].at_s + interval) / args.step_time)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = {"step_time_s": args.step_time, "steps": steps, "interval_s": interval, "per_segment": per_segment,
                "trace": TRACE.name, "trace_compress": args.compress, "seed": args.seed,
                "ray_train_health_check_interval_s": args.ray_poll_s, "room_cpus": args.room}
    report = run(systems, faults, steps, args.step_time, args.ray_poll_s, args.seed, out, settings,
                 checkpointing=chosen_checkpointing(args), room=args.room)
    print("\n" + table(report))
    print(f"\ntotal {report['total_wall_s']:.1f} s; {out / 'preemption.json'}, {out / 'preemption.png'}")


if __name__ == "__main__":
    main()
