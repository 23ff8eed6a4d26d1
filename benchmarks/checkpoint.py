"""Checkpoint cost, two ways: storage throughput against raw fsspec, and the training stall per report.

Why: elastic_train stores checkpoints itself (`checkpoint/storage.py`: one object per file, a
manifest with the size and checksum of every file written last) and its `report()` returns once the
checkpoint is snapshotted in memory, uploading in the background. Both claims have a price and a
payoff that only a measurement shows: what the manifest and the retries cost against copying the
same bytes with fsspec directly, and how long the training loop waits in `report()` against Ray
Train, which copies the checkpoint to storage inside `report()`.

What:

1. Storage throughput. A checkpoint of 4 shard files (one per simulated rank) of random bytes
   (quick: 4 x 16 MB, full: 4 x 64 MB), to local disk (a temporary directory) and to S3 (a moto
   server on 127.0.0.1, reached through s3fs). For each store, alternating ours and raw:
   * `save_serial`: ours is `RunStorage.write_part` once per shard, then `commit` of a `Manifest`
     listing every file; raw is `fs.pipe_file` of the same files on an fsspec filesystem built from
     the same URL and storage options.
   * `save_parallel`: the same, with 4 threads each writing its shard (ranks write in parallel);
     ours then commits the merged manifest.
   * `load`: ours is `RunStorage.read_verified` of the committed checkpoint (each file's size and
     checksum checked against the manifest); raw is `fs.cat_file` of each file.
   MB/s is the payload (shards only, 1 MB = 2**20 bytes) over the wall time; the median of 3
   repeats (quick: 2); the ratio is ours / raw. Ours hashes every byte (XXH3-128), on save and on
   load, and raw does not: that is the manifest's cost, included on purpose.

2. Training stall per report. One loop, written once and parameterized by the API module it calls
   (`elastic_train` or `ray.train`): 2 workers, a 100 ms step (a tiny model step plus sleep),
   rank 0 writes `model.pt` (torch.save of ~8 MB of float tensors) into a fresh temporary directory
   and reports `Checkpoint.from_directory` every step, the other rank reports metrics only (Ray
   Train's recommended pattern). Only the wall time of the `report()` call on rank 0 is measured:
   writing model.pt is the same for both, the call is what the library adds. The first 3 steps are
   skipped. Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
   (2 s by default) and a report blocks until polled: it is run with 0.1 s, and in full mode also
   with the default (what users get). Also recorded: fit()'s wall time against steps x step time.

Each system runs on a fresh Ray instance, one after the other (this machine is noisy: compare the
columns of one run, not runs of different days).

    python -m benchmarks.checkpoint --out results/checkpoint
    python -m benchmarks.checkpoint --quick --out /tmp/bench_ckpt
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import boto3
import fsspec
import ray
import ray.train
import torch
from fsspec.core import url_to_fs
from moto.server import ThreadedMotoServer
from ray.train.torch import TorchTrainer as RayTorchTrainer

import elastic_train as et
from benchmarks.common import free_port, machine_facts
from elastic_train.checkpoint.manifest import CHECKSUM, Manifest, file_facts
from elastic_train.checkpoint.storage import RunStorage

logger = logging.getLogger("benchmarks.checkpoint")

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20
SHARDS = 4
NUM_WORKERS = 2
SKIP_STEPS = 3
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
API = {"elastic_train": "elastic_train", "ray_train": "ray.train"}


# -- part 1: storage throughput ---------------------------------------------------------------------

def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


class StoreBench:
    """Ours against raw fsspec on one store (a URL plus storage options)."""

    def __init__(self, label: str, url: str, options: dict[str, Any], shards: dict[str, bytes]):
        self.label, self.url, self.options, self.shards = label, url, options, shards
        self.fs, self.root = url_to_fs(url, **options)
        self.local = "file" in ((self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol)
        self.payload = sum(len(d) for d in shards.values())

    # ours
    def _ours_save(self, name: str, parallel: bool) -> tuple[float, tuple[RunStorage, Any]]:
        storage = RunStorage(self.url, name, self.options)
        storage.fs.exists(storage.root)  # untimed: s3fs opens its session on first use; raw's is already open
        index = 1

        def run() -> Any:
            if parallel:
                with ThreadPoolExecutor(SHARDS) as pool:
                    parts = list(pool.map(lambda item: storage.write_part(index, dict([item])), self.shards.items()))
            else:
                parts = [storage.write_part(index, {n: d}) for n, d in self.shards.items()]
            merged = {k: v for part in parts for k, v in part.items()}
            return storage.commit(index, Manifest(step=index, generation=0, world_size=SHARDS, files=merged))

        seconds, committed = _timed(run)
        return seconds, (storage, committed)

    def _ours_load(self, storage: RunStorage, committed: Any) -> float:
        seconds, files = _timed(lambda: storage.read_verified(committed))
        assert sum(len(d) for d in files.values()) == self.payload
        return seconds

    # raw
    def _raw_save(self, name: str, parallel: bool) -> tuple[float, str]:
        folder = f"{self.root.rstrip('/')}/{name}/checkpoint_000001"

        def put(item: tuple[str, bytes]) -> None:
            if self.local:
                self.fs.makedirs(folder, exist_ok=True)
            self.fs.pipe_file(f"{folder}/{item[0]}", item[1])

        def run() -> None:
            if parallel:
                with ThreadPoolExecutor(SHARDS) as pool:
                    list(pool.map(put, self.shards.items()))
            else:
                for item in self.shards.items():
                    put(item)

        seconds, _ = _timed(run)
        return seconds, folder

    def _raw_load(self, folder: str) -> float:
        seconds, files = _timed(lambda: [self.fs.cat_file(f"{folder}/{n}") for n in self.shards])
        assert sum(len(d) for d in files) == self.payload
        return seconds

    def _remove(self, name: str) -> None:
        path = f"{self.root.rstrip('/')}/{name}"
        self.fs.invalidate_cache()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def run(self, repeats: int) -> dict[str, Any]:
        seconds: dict[str, dict[str, list[float]]] = {
            op: {"ours": [], "raw": []} for op in ("save_serial", "save_parallel", "load")}
        for rep in range(-1, repeats):  # rep -1: an untimed warm-up round (first writes into a store are slower)
            for parallel in (False, True):
                op = "save_parallel" if parallel else "save_serial"
                # alternate which goes first, so neither always gets the warmer cache / emptier store
                order = ("ours", "raw") if rep % 2 == 0 else ("raw", "ours")
                for who in order:
                    name = f"{who}_{op}_{rep}_{uuid.uuid4().hex[:6]}"
                    if who == "ours":
                        save, (storage, committed) = self._ours_save(name, parallel)
                        load = None if parallel else self._ours_load(storage, committed)
                    else:
                        save, folder = self._raw_save(name, parallel)
                        load = None if parallel else self._raw_load(folder)
                    self._remove(name)
                    if rep >= 0:
                        seconds[op][who].append(save)
                        if load is not None:
                            seconds["load"][who].append(load)
            logger.info("%s: %s done", self.label, f"repeat {rep + 1}/{repeats}" if rep >= 0 else "warm-up")
        ops = {}
        for op, by in seconds.items():
            row: dict[str, Any] = {}
            for who, values in by.items():
                median = statistics.median(values)
                row[who] = {"seconds": [round(v, 4) for v in values], "seconds_median": round(median, 4),
                            "mb_per_s": round(self.payload / MB / median, 1)}
            row["ratio_ours_over_raw"] = round(row["ours"]["mb_per_s"] / row["raw"]["mb_per_s"], 3)
            ops[op] = row
        return {"store": self.label, "url": self.url, "ops": ops}


def storage_benchmark(shard_mb: int, repeats: int) -> dict[str, Any]:
    logger.info("storage: %d shards of %d MB, %d repeats", SHARDS, shard_mb, repeats)
    shards = {f"shard_{r}.bin": os.urandom(shard_mb * MB) for r in range(SHARDS)}
    hashing = statistics.median(_timed(lambda: file_facts(shards))[0] for _ in range(3))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_local_") as tmp:
        results.append(StoreBench("local", tmp, {}, shards).run(repeats))
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        bucket = "bench-checkpoint"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                   "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True,
                   "use_listings_cache": False}
        results.append(StoreBench("s3 (moto)", f"s3://{bucket}/bench", options, shards).run(repeats))
    finally:
        server.stop()
    return {
        "shards": SHARDS,
        "shard_mb": shard_mb,
        "payload_mb": SHARDS * shard_mb,
        "repeats": repeats,
        "checksum": CHECKSUM,
        "checksum_mb_per_s": round(SHARDS * shard_mb / hashing, 1),
        "checksum_payload_s": round(hashing, 4),
        "statistic": "median over repeats, after one untimed warm-up round",
        "note": (f"ours includes {CHECKSUM} hashing of every byte (the manifest: on save write_part hashes each file, "
                 "on load read_verified checks each) plus, on commit, a listing of the folder and the manifest write; raw does none of it. "
                 "Both filesystems have their session open before timing (s3fs opens it lazily, on first use). "
                 "checksum_payload_s is the time to hash the whole payload once, in this process: ours is expected "
                 "to take about raw + that when it hashes serially. "
                 "save_parallel: 4 threads, one shard each (ranks writing in parallel), in one process. "
                 "S3 is a moto ThreadedMotoServer in this same process (it shares the GIL and the 2 cores with "
                 "the client), so its absolute MB/s are moto's, not S3's; compare ours against raw. "
                 "Local loads read from the page cache."),
        "stores": results,
    }


# -- part 2: training stall per report --------------------------------------------------------------

def train_loop(config: dict[str, Any]) -> None:
    """The workload, against the API module `config["api"]` names ("elastic_train" or "ray.train")."""
    api = importlib.import_module(config["api"])
    rank = api.get_context().get_world_rank()
    log = Path(config["log_dir"])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # ~8 MB of float32 tensors, saved as the checkpoint (the tiny model rides along)
    weights = {f"layer_{i}": torch.randn(512, 1024) for i in range(config["tensors"])}
    for step in range(1, config["steps"] + 1):
        started = time.perf_counter()
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config["step_time"])
        metrics = {"loss": loss.item(), "step": step}
        if rank != 0:
            api.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            saving = time.perf_counter()
            torch.save({**weights, **model.state_dict()}, Path(d) / "model.pt")
            reporting = time.perf_counter()
            api.report(metrics, checkpoint=api.Checkpoint.from_directory(d))
            done = time.perf_counter()
        record = {"step": step, "time": time.time(), "report_s": done - reporting, "save_s": reporting - saving,
                  "step_s": done - started}
        with open(log / "report.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _count_persisted(system: str, storage: Path, name: str) -> int:
    if system == "elastic_train":
        return len(RunStorage(str(storage), name).committed())
    return sum(1 for p in (storage / name).glob("checkpoint_*") if p.is_dir())


def run_stall(label: str, system: str, poll_s: float | None, steps: int, step_time: float, tensors: int,
              workdir: Path) -> dict[str, Any]:
    """Run the loop under `system` on a fresh Ray instance; returns rank 0's report() durations."""
    shutil.rmtree(workdir, ignore_errors=True)
    log = workdir / "log"
    log.mkdir(parents=True)
    storage, name = workdir / "storage", "stall"
    config = {"api": API[system], "log_dir": str(log), "steps": steps, "step_time": step_time, "tensors": tensors}
    saved_poll = os.environ.pop(POLL_ENV, None)
    if poll_s is not None:
        os.environ[POLL_ENV] = str(poll_s)  # the driver's value is propagated to Ray Train's controller
    ray.init(num_cpus=NUM_WORKERS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        started, fit_started = time.monotonic(), time.time()
        if system == "ray_train":
            RayTorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=ray.train.ScalingConfig(num_workers=NUM_WORKERS),
                run_config=ray.train.RunConfig(storage_path=str(storage), name=name),
            ).fit()
        else:
            et.TorchTrainer(
                train_loop, train_loop_config=config,
                scaling_config=et.ScalingConfig(num_workers=NUM_WORKERS),
                run_config=et.RunConfig(storage_path=str(storage), name=name),
            ).fit()
        wall, fit_ended = time.monotonic() - started, time.time()
    finally:
        ray.shutdown()
        os.environ.pop(POLL_ENV, None)
        if saved_poll is not None:
            os.environ[POLL_ENV] = saved_poll
    records = sorted((json.loads(line) for line in (log / "report.jsonl").read_text().splitlines()),
                     key=lambda r: r["step"])
    measured = [r for r in records if r["step"] > SKIP_STEPS]
    stalls = [r["report_s"] for r in measured]
    median = statistics.median(stalls)
    loop_started = records[0]["time"] - records[0]["step_s"]
    return {
        "label": label,
        "system": system,
        "ray_train_health_check_interval_s": (poll_s if poll_s is not None else "default (2.0)")
        if system == "ray_train" else None,
        "steps": steps,
        "steps_measured": len(stalls),
        "rank0_report_steps_logged": len(records),
        "report_s": [round(s, 4) for s in stalls],
        "report_s_median": round(median, 4),
        "report_s_p90": round(_percentile(stalls, 0.9), 4),
        "report_s_max": round(max(stalls), 4),
        "report_median_pct_of_step": round(100 * median / step_time, 1),
        "save_model_pt_s_median": round(statistics.median(r["save_s"] for r in measured), 4),
        "rank0_step_s_median": round(statistics.median(r["step_s"] for r in measured), 4),
        "fit_wall_s": round(wall, 2),
        "ideal_s": round(steps * step_time, 2),
        "fit_overhead_s": round(wall - steps * step_time, 2),
        "loop_wall_s": round(records[-1]["time"] - loop_started, 2),
        "fit_to_first_step_s": round(loop_started - fit_started, 2),
        "last_step_to_fit_return_s": round(fit_ended - records[-1]["time"], 2),
        "checkpoints_persisted": _count_persisted(system, storage, name),
        "checkpoint_mb": round((tensors * 512 * 1024 + 64 * 64 + 64) * 4 / MB, 2),
    }


def stall_benchmark(steps: int, step_time: float, with_default_poll: bool, out: Path) -> dict[str, Any]:
    tensors = 4  # 4 x 512 x 1024 float32 = 8 MB
    runs = [("elastic_train", "elastic_train", None), ("ray_train (poll 0.1 s)", "ray_train", 0.1)]
    if with_default_poll:
        runs.append(("ray_train (default poll)", "ray_train", None))
    results = []
    for i, (label, system, poll_s) in enumerate(runs):
        logger.info("stall: %s, %d steps of %.0f ms", label, steps, step_time * 1000)
        results.append(run_stall(label, system, poll_s, steps, step_time, tensors, out / f"stall_{i}_{system}"))
        logger.info("stall: %s: report() median %.1f ms, fit %.1f s", label, results[-1]["report_s_median"] * 1000,
                    results[-1]["fit_wall_s"])
    return {
        "workers": NUM_WORKERS,
        "steps": steps,
        "skipped_first_steps": SKIP_STEPS,
        "step_time_s": step_time,
        "checkpoint": "rank 0 only: model.pt, torch.save of ~8 MB of float32 tensors, every step",
        "measured": "wall time of rank 0's report() call (writing model.pt excluded)",
        "fit_overhead_s": "fit() wall time minus steps x step_time: start-up, shutdown and every stall",
        "loop_wall_s": "rank 0's first step start to its last report's return (the loop alone)",
        "fit_to_first_step_s": "fit() call to rank 0's first step start (worker start-up)",
        "last_step_to_fit_return_s": "rank 0's last report's return to fit() returning (flush and tear-down)",
        "systems": results,
    }


# -- main -------------------------------------------------------------------------------------------

def table(report: dict[str, Any]) -> str:
    """The report's markdown tables."""
    lines: list[str] = []
    if "storage" in report:
        s = report["storage"]
        lines += [f"storage: {s['shards']} x {s['shard_mb']} MB, median of {s['repeats']}; ours hashes every byte "
                  f"({s['checksum']} alone: {s['checksum_mb_per_s']:.0f} MB/s here)", "",
                  "| store | op | ours MB/s | raw MB/s | ours/raw |", "| --- | --- | --- | --- | --- |"]
        for store in s["stores"]:
            for op, row in store["ops"].items():
                lines.append(f"| {store['store']} | {op} | {row['ours']['mb_per_s']:.0f} | {row['raw']['mb_per_s']:.0f} "
                             f"| {row['ratio_ours_over_raw']:.2f} |")
        lines.append("")
    if "stall" in report:
        s = report["stall"]
        lines += [f"stall: rank 0's report() of an ~8 MB checkpoint, {s['steps']} steps of "
                  f"{s['step_time_s'] * 1000:.0f} ms, first {s['skipped_first_steps']} skipped", "",
                  "| system | report() median | p90 | median % of step | loop | fit wall | fit - steps x step "
                  "| start-up | tear-down | persisted |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in s["systems"]:
            lines.append(f"| {r['label']} | {r['report_s_median'] * 1000:.1f} ms | {r['report_s_p90'] * 1000:.1f} ms "
                         f"| {r['report_median_pct_of_step']:.1f}% | {r['loop_wall_s']:.1f} s | {r['fit_wall_s']:.1f} s "
                         f"| {r['fit_overhead_s']:.1f} s | {r['fit_to_first_step_s']:.1f} s "
                         f"| {r['last_step_to_fit_return_s']:.1f} s | {r['checkpoints_persisted']}/{r['steps']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="4 x 16 MB shards, 2 repeats, 20 steps, no default-poll Ray Train run")
    parser.add_argument("--shard-mb", type=int, default=None, help="MB per shard (default 64; quick 16)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement (default 3; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per system (default 60; quick 20)")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--parts", default="storage,stall", help="comma-separated, of: storage, stall")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "checkpoint",
                        help="folder for checkpoint.json and the stall runs' logs and checkpoints")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - {"storage", "stall"}:
        parser.error(f"unknown parts {sorted(unknown)}; choose from storage, stall")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    shard_mb = args.shard_mb or (16 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 3)
    steps = args.steps or (20 if args.quick else 60)
    if steps <= SKIP_STEPS:
        parser.error(f"--steps must be more than the {SKIP_STEPS} skipped")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "checkpoint",
        "quick": args.quick,
        "machine": {**machine_facts(), "fsspec": fsspec.__version__},
    }
    if "storage" in parts:
        report["storage"] = storage_benchmark(shard_mb, repeats)
    if "stall" in parts:
        report["stall"] = stall_benchmark(steps, args.step_time, not args.quick, out)
    report["total_wall_s"] = round(time.monotonic() - started, 2)
    (out / "checkpoint.json").write_text(json.dumps(report, indent=2) + "\n")

    print(table(report))
    print(f"\ntotal {report['total_wall_s']:.1f} s; {out / 'checkpoint.json'}")


if __name__ == "__main__":
    main()
