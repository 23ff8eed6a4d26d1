"""Transformers loops for tests/test_transformers.py: a tiny GPT-2 built from its config (nothing is
downloaded) trained by a `transformers.Trainer` on the run's workers.

Transformers is imported inside the functions: unpickling a loop (when a worker is placed) then
costs no Transformers import, and a replacement worker parks as fast as any other.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import elastic_train as et
import elastic_train.huggingface  # noqa: F401 - a worker registers the Accelerate reset when it unpickles a loop
from tests.loops import fault_once, log_progress

SAMPLES, SEQUENCE, VOCAB = 48, 8, 64
PER_DEVICE_BATCH = 4


def token_dataset() -> list[dict[str, torch.Tensor]]:
    """Seeded token sequences, each with its sample id (the same in every process)."""
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t, "labels": t, "sample_ids": torch.tensor(i)} for i, t in enumerate(tokens)]


def tiny_gpt2() -> Any:
    """A 2-layer GPT-2 from its config, seeded; no dropout, so a step does not depend on RNG state."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQUENCE,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


@functools.cache
def _observed_classes() -> tuple[type, type]:
    """A Trainer that logs each step's samples, and a callback that injects the configured fault."""
    from transformers import Trainer, TrainerCallback

    class ObservedTrainer(Trainer):
        """Logs, on each rank, the sample ids of each step before its loss is computed; then takes
        `step_time` of simulated compute (`step_time_alone` below the run's full size)."""

        observe: dict[str, Any]

        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            ids = inputs.pop("sample_ids")
            context = et.get_context()
            log_progress(self.observe["log_dir"], rank=context.get_world_rank(), world=context.get_world_size(),
                         generation=context.get_generation(), step=self.state.global_step + 1, ids=ids.tolist())
            alone = context.get_world_size() < context.assignment.max_world_size
            time.sleep(self.observe.get("step_time_alone" if alone else "step_time", 0.0))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    class Faults(TrainerCallback):
        def __init__(self, config: dict[str, Any]) -> None:
            self.config = config

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            fault_once(self.config, state.global_step + 1, et.get_context().get_world_rank())

    return ObservedTrainer, Faults


def report_loop(config: dict[str, Any]) -> None:
    """Ray's Transformers guide pattern: `RayTrainReportCallback`, `prepare_trainer`, resumption from
    `get_checkpoint()`. Every `save_steps` steps the Trainer saves and the callback reports. Each
    generation logs the world Accelerate sees at its start and, at its end, whether the run's process
    group outlived `trainer.train()` and `trainer.end()`."""
    from accelerate import PartialState
    from transformers import TrainingArguments

    from elastic_train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    context = et.get_context()
    state = PartialState(cpu=True)  # what a loop asks Accelerate before its Trainer exists: this generation's world
    log_progress(config["log_dir"], rank=context.get_world_rank(), world=context.get_world_size(),
                 generation=context.get_generation(), accelerate=[state.process_index, state.num_processes])
    observed_trainer, faults = _observed_classes()
    args = TrainingArguments(
        output_dir=os.path.join(config["log_dir"], "output"), num_train_epochs=config["epochs"],
        per_device_train_batch_size=PER_DEVICE_BATCH, learning_rate=1e-3, save_strategy="steps",
        save_steps=config["save_steps"], logging_steps=1, report_to="none", disable_tqdm=True,
        remove_unused_columns=False, dataloader_pin_memory=False, ddp_find_unused_parameters=False, seed=0,
        **config.get("args", {}),
    )
    trainer = observed_trainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset(),
                               callbacks=[RayTrainReportCallback(), faults(config)])
    trainer.observe = config
    trainer = prepare_trainer(trainer, **config.get("prepare", {}))
    group = dist.group.WORLD
    checkpoint = et.get_checkpoint()
    if checkpoint is None:
        trainer.train()
    else:
        with checkpoint.as_directory() as d:
            trainer.train(resume_from_checkpoint=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    trainer.end()
    log_progress(config["log_dir"], rank=context.get_world_rank(), generation=context.get_generation(),
                 hf_world=args.world_size, group_kept=dist.is_initialized() and dist.group.WORLD is group)


def seed_train_func(config: dict[str, Any]) -> None:
    """The seed's loop: a Trainer with a relative output_dir, `trainer.train()`, nothing of elastic_train.
    Then it logs what the Trainer saw and where it wrote."""
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2()
    training_args = TrainingArguments(output_dir="./output", num_train_epochs=1, per_device_train_batch_size=8,
                                      learning_rate=2e-5, report_to="none", disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=token_dataset())
    trainer.train()
    log_progress(config["log_dir"], rank=dist.get_rank(), hf_world=training_args.world_size,
                 process_index=training_args.process_index, global_step=trainer.state.global_step,
                 cwd=os.getcwd(), saved=sorted(os.listdir("output")))
