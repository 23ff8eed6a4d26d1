"""What the benchmarks share: the workload they run under each system, and the machine facts
recorded next to their figures."""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ray
import torch
from torch.utils.data import DataLoader

import elastic_train as et


def machine_facts() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__}


def start_ray(num_cpus: int, env: dict[str, str]) -> None:
    """A fresh Ray instance whose processes inherit `env`, as a user's script gives them its
    environment: with no runtime env, an actor starts in one of Ray's idle worker processes (one made
    for a runtime env takes ~0.4 s more, each replacement of every system alike)."""
    os.environ.update(env)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def spread(name: str, values: list[float | None]) -> dict[str, Any]:
    """`values` (None: not measured) with their median, min and max, as `name`, `name_median`, ..."""
    measured = [v for v in values if v is not None]
    return {name: values,
            f"{name}_median": round(statistics.median(measured), 3) if measured else None,
            f"{name}_min": min(measured, default=None), f"{name}_max": max(measured, default=None)}


def median_spread(report: dict[str, Any], name: str) -> str:
    """A table cell for a `spread`: "median s (min-max)"."""
    if report[f"{name}_median"] is None:
        return "-"
    return f"{report[f'{name}_median']:.3f} s ({report[f'{name}_min']:.3f}-{report[f'{name}_max']:.3f})"


def add_systems_option(parser: argparse.ArgumentParser, systems: tuple[str, ...]) -> None:
    parser.add_argument("--systems", default=",".join(systems), help="comma-separated, of: " + ", ".join(systems))


def chosen_systems(parser: argparse.ArgumentParser, args: argparse.Namespace, systems: tuple[str, ...]) -> list[str]:
    """The systems `--systems` names, in its order; an unknown one is a usage error."""
    chosen = args.systems.split(",")
    if unknown := set(chosen) - set(systems):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(systems)}")
    return chosen


@dataclass(frozen=True)
class Checkpointing:
    """How the workload checkpoints: rank 0 reports one every `every` steps (and at the last), every
    system alike. With `live`, elastic_train's ranks instead all report their live state every step
    (`Checkpoint.from_dict`: held in memory, serialized only to be stored or for a recovery), and every
    `every`-th report is stored (`CheckpointConfig.store_every_n_reports`). With `every` 0 no system
    reports a checkpoint: elastic_train keeps its model and optimizer live
    (`prepare_model(model, live_state=True)`); Ray Train, with nothing to resume from, starts over.
    `part_safe_wait_s`: elastic_train's `ElasticConfig.part_safe_wait_s` (None: its default)."""

    every: int = 1
    live: bool = False
    part_safe_wait_s: float | None = None

    def loop_config(self) -> dict[str, Any]:
        return {"checkpoint_every": self.every, "live": self.live}

    def elastic_config(self) -> et.CheckpointConfig | None:
        return et.CheckpointConfig(store_every_n_reports=self.every) if self.live else None

    def elastic_runtime(self) -> et.ElasticConfig:
        return et.ElasticConfig(**({} if self.part_safe_wait_s is None else {"part_safe_wait_s": self.part_safe_wait_s}))

    def describe(self) -> str:
        if self.every == 0:
            return "no checkpoint in the loop (elastic_train: its model and optimizer kept live)"
        stored = f"a checkpoint every {self.every} step(s)"
        described = f"elastic_train: live state every step, {stored} stored; others: {stored}" if self.live else stored
        return described + ("" if self.part_safe_wait_s is None else f"; part_safe_wait_s={self.part_safe_wait_s:g}")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-every", type=int, default=1,
                        help="rank 0 reports a checkpoint every this many steps (and at the last), every system alike; "
                             "0: no checkpoint in the loop (elastic_train keeps its model and optimizer live)")
    parser.add_argument("--live", action="store_true",
                        help="elastic_train: every rank reports its live state every step (Checkpoint.from_dict), "
                             "every --checkpoint-every-th stored")
    parser.add_argument("--part-safe-wait-s", type=float, default=None,
                        help="elastic_train's ElasticConfig.part_safe_wait_s (default: its own; 0: a report returns "
                             "before its part is copied or stored)")


def add_room_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--room", type=int, default=1,
                        help="CPUs the Ray instance has beyond the workers', every system alike: room for "
                             "elastic_train's warm spare (ElasticConfig.warm_spares_per_node). 0: none, as the "
                             "figures before 2026-12-07 were measured")


def chosen_checkpointing(args: argparse.Namespace) -> Checkpointing:
    if args.checkpoint_every < 0 or (args.live and args.checkpoint_every == 0):
        raise SystemExit("--checkpoint-every must be at least 1 with --live (the live state's storing cadence), "
                         "and 0 or more without it")
    return Checkpointing(args.checkpoint_every, args.live, args.part_safe_wait_s)


def reported_step(result: Any) -> int | None:
    """The last step a run's `Result` names. Ray Train's Result keeps metrics only with a checkpoint:
    None for a loop that reports none."""
    return (result.metrics or {}).get("step")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WIDTH = 64  # the MLP's width: 4 x Linear(64, 64), 0.13 MB of parameters and momentum


def build_model(width: int = WIDTH) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmarks' model and optimizer: a small MLP, identical on every rank (seed 0). A larger
    `width` makes the state a recovery restores larger (2048: 128 MB of parameters and momentum)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(layer for _ in range(4)
                                  for layer in (torch.nn.Linear(width, width), torch.nn.ReLU())))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


BATCH = 32  # samples per worker and step
TABLE = 4096  # distinct inputs: a sample's input is row `id % TABLE` of a seeded table


def batch(step: int, rank: int, width: int = WIDTH) -> torch.Tensor:
    """A seeded batch per step and rank (for loops that draw no data: benchmarks.overhead)."""
    return torch.randn(BATCH, width, generator=torch.Generator().manual_seed(step * 2 + rank))


def train_step(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               step_time: float) -> torch.Tensor:
    """One step of the benchmarks' workload on inputs `x`, plus `step_time` of simulated compute;
    returns the loss."""
    loss = ddp(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(step_time)
    return loss


def train_loop(config: dict[str, Any]) -> None:
    """The benchmarks' workload, against the API module `config["api"]` names ("elastic_train" or
    "ray.train"), written as Ray Train's guides write a loop: a small DDP model from `prepare_model`,
    batches of sample ids from `prepare_data_loader` (one epoch long enough for the run; a sample's
    input is a row of a seeded table), `step_time` of simulated compute per step, rank 0 reporting a
    checkpoint every `checkpoint_every` steps (default 1; Ray Train's usual pattern), resumed from
    `get_checkpoint()`; the other reports carry metrics only. The rank is read where it is used. With
    `live` (elastic_train only: see `Checkpointing`), every rank reports its live state every step
    instead; with `checkpoint_every` 0, no checkpoint at all (elastic_train keeps the model and
    optimizer live). Every rank logs each step's start and end to `<log_dir>/progress.jsonl` before
    reporting. With `kills` and `kill_every`, rank 1 SIGKILLs itself on schedule (see `kill_if_due`)."""
    api = importlib.import_module(config["api"])
    api_torch = importlib.import_module(config["api"] + ".torch")
    context = api.get_context()
    log = Path(config["log_dir"])
    width = config.get("width", WIDTH)
    model, optimizer = build_model(width)
    live = config.get("live", False) and config["api"] == "elastic_train"
    every = config.get("checkpoint_every", 1)
    kept = every == 0 and config["api"] == "elastic_train"  # no checkpoint: the model and optimizer kept live
    start = context.get_resume_index() + 1 if kept else 1
    rank = context.get_world_rank() if config.get("data") == "own" else None  # read once, as hand-written loops do
    checkpoint = api.get_checkpoint()
    if checkpoint is not None:
        if live:
            state = checkpoint.to_dict()
        else:
            with checkpoint.as_directory() as d:
                state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    ddp = api_torch.prepare_model(model, live_state=True) if kept else api_torch.prepare_model(model)
    for step, inputs, drawn in workload_steps(api_torch, context, config, start, width, rank):
        began = time.time()
        loss = train_step(ddp, optimizer, inputs, config["step_time"])
        record = {"start": began, "time": time.time(), "pid": os.getpid(), "rank": context.get_world_rank(),
                  "world_size": context.get_world_size(), "step": step, **drawn}
        with open(log / "progress.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        metrics = {"loss": loss.item(), "step": step}
        if live:
            api.report(metrics, checkpoint=api.Checkpoint.from_dict(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}))
            continue
        due = every > 0 and (step % every == 0 or step == config["steps"])
        if context.get_world_rank() != 0 or not due:
            api.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       Path(d) / "state.pt")
            api.report(metrics, checkpoint=api.Checkpoint.from_directory(d))


def workload_steps(api_torch: Any, context: Any, config: dict[str, Any], start: int, width: int,
                   rank: int | None = None) -> Iterator[tuple[int, torch.Tensor, dict[str, Any]]]:
    """The workload's steps from `start` to `config["steps"]`: each step's number, inputs (a batch of
    sample ids, one epoch long enough for the run, each id a row of a seeded table; with
    `config["data"] == "own"`, the ids of `rank`, which the loop read once at its top) and, with
    `config["data"] == "ray"`, what drawing the batch took, its ids and the world size it was drawn at. Rank 1 SIGKILLs itself on
    schedule first (`config["kills"]`, `kill_if_due`)."""
    table = torch.randn(TABLE, width, generator=torch.Generator().manual_seed(0))
    batches = iter(_sample_ids(api_torch, context, config, start, rank))
    step = start - 1
    while True:
        drawing = time.perf_counter()
        ids = next(batches, None)
        drawn = {"fetch_s": time.perf_counter() - drawing, "ids": ids.tolist() if ids is not None else [],
                 "drawn_world": context.get_world_size()} if config.get("data") == "ray" else {}
        step += 1
        if ids is None or step > config["steps"]:
            return
        if config.get("kills") and context.get_world_rank() == 1:  # no read of the rank without kills to make
            kill_if_due(Path(config["log_dir"]), step, config["kills"], config["kill_every"])
        yield step, table[ids % TABLE], drawn


MAX_WORKERS = 16  # the most workers a benchmark's run has


def dataset_rows(config: dict[str, Any], workers: int) -> int:
    """Rows of the Ray Data dataset (`config["data"] == "ray"`): one epoch long enough for the run."""
    return (config["steps"] + 1) * BATCH * workers


def _sample_ids(api_torch: Any, context: Any, config: dict[str, Any], start: int,
                rank: int | None) -> Iterator[torch.Tensor]:
    """Each step's sample ids: from `prepare_data_loader`; with `config["data"] == "ray"` from the
    "train" dataset's shard (`get_dataset_shard`, `iter_torch_batches`; ids in its "id" column); with
    "own", no loader: rank `rank`'s own slice of each step's ids, from step `start`."""
    if config.get("data") == "own":
        yield from (torch.arange(BATCH) + (step * MAX_WORKERS + rank) * BATCH for step in itertools.count(start))
    elif config.get("data") == "ray":
        api = importlib.import_module(config["api"])
        for batch in api.get_dataset_shard("train").iter_torch_batches(batch_size=BATCH):
            yield batch["id"]
    else:
        # Long enough at any world size the benchmarks run: a dataset sized by the world read here would be
        # held by the loop, and each recovery that changes the world would re-enter it (faithful/reads.py).
        samples = torch.arange(dataset_rows(config, MAX_WORKERS))
        yield from api_torch.prepare_data_loader(DataLoader(samples, batch_size=BATCH))


def kill_if_due(log: Path, step: int, kills: int, every: int) -> None:
    """SIGKILL this process if a kill not yet done is due at or before `step` (the earliest one)."""
    for k in range(kills):
        due = every * (k + 1)
        if due > step:
            return
        try:
            fd = os.open(log / f"kill_{k:03d}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, json.dumps({"kill": k, "due_step": due, "step": step, "time": time.time()}).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
