"""How long a run takes to start and end: `fit()` of a loop that reports once, next to Ray Train.

Why: every run pays it before its first step, and every test of the suite that trains on Ray pays
it too. Our supervisor starts first and then its workers, each a process of its own: what each
imports is on that path (the supervisor imports no torch: run_spec.py, worker/actor.py).

What: `TorchTrainer(loop, ScalingConfig(num_workers=2)).fit()` on one Ray instance, `--runs` times
per system, the systems alternating; the loop reports `{"x": 1}` once. For elastic_train, the run's
events (as seconds after `fit()` was called) say where the time went: the supervisor's first event
(`run_started`), the last worker ready, the first generation opened.

    python -m benchmarks.start --runs 5 --out results/start
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from benchmarks.common import machine_facts, start_ray

SYSTEMS = {"elastic_train": "elastic_train", "ray_train": "ray.train"}


def _loop(config: dict) -> None:
    importlib.import_module(config["api"]).report({"x": 1})


def one_fit(system: str) -> dict[str, float]:
    api = importlib.import_module(SYSTEMS[system])
    trainer_module = importlib.import_module(f"{SYSTEMS[system]}.torch")
    with tempfile.TemporaryDirectory() as storage:
        started = time.time()
        trainer_module.TorchTrainer(_loop, train_loop_config={"api": SYSTEMS[system]},
                                    scaling_config=api.ScalingConfig(num_workers=2),
                                    run_config=api.RunConfig(storage_path=storage, name="start")).fit()
        facts = {"fit_s": time.time() - started}
        if system == "elastic_train":
            events = [json.loads(line) for line in Path(storage, "start", "events.jsonl").read_text().splitlines()]
            first = {}
            for e in events:
                first.setdefault(e["kind"], e["time"])
            facts["supervisor_s"] = first["run_started"] - started
            facts["workers_ready_s"] = max(e["time"] for e in events if e["kind"] == "worker_ready") - started
            facts["first_generation_s"] = first["generation"] - started
    return facts


def table(report: dict[str, Any]) -> str:
    rows = ["| system | fit() of a one-report loop, median (min-max) | supervisor's first event | workers ready | "
            "first generation |", "| --- | --- | --- | --- | --- |"]
    for system, runs in report["systems"].items():
        def median(key: str) -> str:
            values = [r[key] for r in runs if key in r]
            return f"{statistics.median(values):.2f} s" if values else "-"
        fits = [r["fit_s"] for r in runs]
        rows.append(f"| {system} | {statistics.median(fits):.2f} s ({min(fits):.2f}-{max(fits):.2f}) | "
                    f"{median('supervisor_s')} | {median('workers_ready_s')} | {median('first_generation_s')} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 runs a system")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--out", type=Path, default=Path("results/start"))
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    start_ray(2, {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})  # the loop's module, in every process
    report: dict[str, Any] = {"machine": machine_facts(), "runs": runs, "systems": {s: [] for s in args.systems}}
    try:
        one_fit(args.systems[0])  # the first run on a fresh instance also starts Ray's own processes: not counted
        for _ in range(runs):
            for system in args.systems:
                report["systems"][system].append(one_fit(system))
    finally:
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "start.json").write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
