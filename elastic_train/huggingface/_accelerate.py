"""Accelerate's process-wide state, once per generation.

Accelerate keeps the world (size, rank, device, distributed type) in class-level singletons:
`PartialState`, `AcceleratorState`, `GradientState`. They live as long as the process, and a
survivor's process outlives its generation: unless they are reset, the next generation's
`TrainingArguments` and `Trainer` would see the old world. Accelerate never creates the process
group here (it only calls `init_process_group` when none is initialized, and elastic_train has
joined the generation's before the loop runs).

Accelerate also reads the environment: the variables torchrun sets and `ACCELERATE_TORCH_DEVICE` (the
worker exports them for each generation, as Ray Train does), and `ACCELERATE_USE_CPU`.
On a CPU worker, `TrainingArguments()` without `use_cpu=True` makes Accelerate skip distributed
training altogether: every rank would train alone, as rank 0, and write rank 0's checkpoint files.
CPU workers therefore get `ACCELERATE_USE_CPU=true` (Ray Train leaves that to the loop).
"""

from __future__ import annotations

import os
import sys

from elastic_train.worker.group.devices import get_device
from elastic_train.worker.loop.session import TrainSession


def export_accelerate_env() -> None:
    """Tell Accelerate that a CPU worker trains distributed."""
    if get_device().type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"


def start_generation(_session: TrainSession) -> None:
    """Session hook: drop the previous generation's Accelerate state (if Accelerate was ever imported
    here) before the loop runs (the world and the device are in the environment the worker exported)."""
    export_accelerate_env()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
