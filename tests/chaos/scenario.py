"""What every chaos scenario shares: the trainer over the invariant loop, attaching the harness,
and the invariants checked after the faults."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import elastic_train as et
from chaos.faults import ChaosContext
from chaos.log import FaultLog
from chaos.targets import RunHandle
from elastic_train.checkpoint.storage import RunStorage
from tests.chaos.invariant_loop import SAMPLES, invariant_loop, reference_params
from tests.helpers import wait_for
from tests.loops import read_progress

EPOCHS, GLOBAL_BATCH = 5, 8
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
MOMENTUM = 0.9  # the live-state loop's
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # float rounding differs with the world size's split


def chaos_trainer(run_dirs: dict, workers: int | tuple[int, int], *, step_time: float = 0.15,
                  storage_path: str | None = None, storage_options: dict | None = None,
                  elastic: et.ElasticConfig | None = None,
                  checkpoint_config: et.CheckpointConfig | None = None, live_state: bool = False,
                  fault: dict | None = None, end_at_world: int = 0) -> et.TorchTrainer:
    """The invariant loop's trainer; with `live_state`, a loop with no checkpoint (its SGD has momentum:
    the optimizer's state must survive too); with `end_at_world`, a loop that ends only at that world
    size (it waits at its end, reporting, for a growth). The loop scales its loss by the world size
    it read before its loop, and its checks assume one world-independent sequence of global batches:
    every recovery re-enters it (`recover_in_place=False`; tests/test_in_place.py covers going on in
    place)."""
    elastic = dataclasses.replace(elastic or et.ElasticConfig(), recover_in_place=False)
    return et.TorchTrainer(
        invariant_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "epochs": EPOCHS, "global_batch": GLOBAL_BATCH,
                           "step_time": step_time, "live_state": live_state, "momentum": MOMENTUM if live_state else 0.0,
                           "fault": fault, "end_at_world": end_at_world},
        scaling_config=et.ScalingConfig(num_workers=workers),
        run_config=et.RunConfig(name="run", storage_path=storage_path or run_dirs["storage"],
                                storage_options=storage_options, elastic_config=elastic,
                                checkpoint_config=checkpoint_config),
    )


def attach(run_dirs: dict, world: int, **context: Any) -> ChaosContext:
    """The harness's view of the run, once `world` workers are training."""
    wait_for(lambda: any(p.get("world") == world for p in read_progress(run_dirs["log_dir"])), 120,
             f"{world} workers training")
    return ChaosContext(RunHandle("run"), FaultLog(), **context)


def steps_redone(log_dir: str) -> int:
    """Steps completed more than once: by rank 0 of each generation that ran them."""
    runs: dict[int, set[int]] = {}
    for p in read_progress(log_dir):
        if p.get("rank") == 0 and "step" in p:
            runs.setdefault(p["step"], set()).add(p["generation"])
    return sum(len(generations) - 1 for generations in runs.values())


def recovery_times(log_dir: str, faults: list[dict[str, Any]]) -> list[float]:
    """Per fault: seconds from the fault to the first step completed in a newer generation."""
    progress = read_progress(log_dir)
    out = []
    for fault in faults:
        before = [p["generation"] for p in progress if p["time"] <= fault["time"] and "step" in p]
        current = max(before, default=-1)
        after = [p["time"] for p in progress if p["time"] > fault["time"] and p.get("generation", -1) > current]
        if after:
            out.append(round(min(after) - fault["time"], 3))
    return out


def longest_stalls(log_dir: str, faults: list[dict[str, Any]], window_s: float = 30.0) -> list[float]:
    """Per fault: the longest gap between two consecutive steps of rank 0 after it, up to the next
    fault (at most `window_s` on)."""
    times = sorted(p["time"] for p in read_progress(log_dir) if p.get("rank") == 0 and "step" in p)
    starts = [f["time"] for f in faults]
    out = []
    for start, end in zip(starts, starts[1:] + [float("inf")]):
        end = min(end, start + window_s)
        before = [t for t in times if t <= start][-1:]
        around = before + [t for t in times if start < t <= end]
        out.append(round(max((b - a for a, b in zip(around, around[1:])), default=0.0), 3))
    return out


def check_invariants(result: et.Result, run_dirs: dict, faults: int, *, redone_per_fault: int = 1,
                     storage_options: dict | None = None, live_state: bool = False) -> dict[str, Any]:
    """The run finished every step, with a fault-free run's parameters, every sample once per
    epoch, every committed checkpoint whole, and at most `redone_per_fault` steps redone per fault.
    With `live_state` the loop reported no checkpoint: rank 0's final state is its return value, and
    nothing was stored."""
    assert result.error is None, result.error
    assert result.metrics["step"] == STEPS
    final = result.return_value if live_state else result.checkpoint.to_dict()
    assert final["step"] == STEPS
    assert torch.equal(final["counts"], torch.full((SAMPLES,), float(EPOCHS))), "a sample was skipped or repeated"
    reference = reference_params(EPOCHS, GLOBAL_BATCH, MOMENTUM if live_state else 0.0)
    for key, value in reference.items():
        torch.testing.assert_close(final["model"][key], value, **TOLERANCE)
    storage = RunStorage.at(result.path, storage_options)
    committed = storage.committed()
    if live_state:
        assert result.checkpoint is None and committed == [], "a state kept for recovery was stored"
    else:
        assert committed and committed[-1].index == STEPS
    for checkpoint in committed:
        assert storage.verify(checkpoint) == []
    redone = steps_redone(run_dirs["log_dir"])
    assert redone <= redone_per_fault * faults, f"{redone} steps redone for {faults} faults"
    return {"redone": redone, "world_sizes": result.world_sizes}
