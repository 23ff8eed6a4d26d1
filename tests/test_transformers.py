"""elastic_train.huggingface: Ray's Transformers names on real Ray. A tiny GPT-2 trains with
`RayTrainReportCallback` and `prepare_trainer`; a worker SIGKILLed mid-epoch leaves the survivor in
its process, which goes on from the checkpoint in memory at the smaller world and grows back, with
no sample skipped or repeated and a fault-free run's final parameters; the seed's
`TransformersTrainer(train_func, scaling_config=...)` runs."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import elastic_train as et
from elastic_train.huggingface import TransformersTrainer
from tests.helpers import make_trainer
from tests.loops import read_progress
from tests.transformers_loops import PER_DEVICE_BATCH, SAMPLES, report_loop, seed_train_func

EPOCHS, SAVE_STEPS = 3, 2
GLOBAL_BATCH = PER_DEVICE_BATCH * 2  # the default on 2 workers at most
STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
HF_FILES = {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            "training_args.bin"}


@pytest.fixture(scope="module")
def fault_free_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fault_free")
    (root / "log").mkdir()
    return {"log_dir": str(root / "log"), "storage": str(root / "storage")}


@functools.cache
def fault_free_run(log_dir: str, storage: str) -> et.Result:
    """2 workers, no fault: made once, by the first test that needs it (the kill test compares with it)."""
    return make_trainer({"log_dir": log_dir, "storage": storage}, 2, report_loop, epochs=EPOCHS,
                        save_steps=SAVE_STEPS).fit()


def model_state(checkpoint: et.Checkpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with checkpoint.as_directory() as d:
        return load_file(os.path.join(d, "checkpoint", "model.safetensors"))


def step_records(log_dir: str) -> list[dict]:
    return [p for p in read_progress(log_dir) if "ids" in p]


def assert_every_epoch_sees_every_sample_once(records: list[dict]) -> None:
    """A step's samples are those of the last generation that ran it (an earlier run of it was undone)."""
    last = {}
    for p in records:
        last[p["step"]] = max(last.get(p["step"], -1), p["generation"])
    assert sorted(last) == list(range(1, STEPS + 1))
    steps_per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        seen = sorted(i for p in records if p["generation"] == last[p["step"]]
                      and (p["step"] - 1) // steps_per_epoch == epoch for i in p["ids"])
        assert seen == list(range(SAMPLES)), f"epoch {epoch}: a sample was skipped or repeated"


@pytest.mark.timeout(120)
def test_tiny_gpt2_reports_hf_checkpoints_on_two_workers(local_ray, fault_free_dirs):
    from transformers import GPT2LMHeadModel

    result = fault_free_run(fault_free_dirs["log_dir"], fault_free_dirs["storage"])
    assert result.metrics["step"] == STEPS and "loss" in result.metrics
    assert result.world_sizes == [2]
    # Every save was reported (the Trainer saves every SAVE_STEPS steps and at the end).
    assert len(result.best_checkpoints) == STEPS // SAVE_STEPS
    # Ranks' files merged by name into one whole Hugging Face checkpoint, under checkpoint/ as in Ray.
    with result.checkpoint.as_directory() as d:
        folder = os.path.join(d, "checkpoint")
        assert HF_FILES | {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(folder))
        model = GPT2LMHeadModel.from_pretrained(folder)
        assert json.loads(Path(folder, "trainer_state.json").read_text())["global_step"] == STEPS
    assert model.config.n_layer == 2
    for name, value in model_state(result.checkpoint).items():
        assert torch.equal(model.state_dict()[name], value)
    # Each step dealt 4 samples to each rank, disjoint; every epoch saw every sample once.
    records = step_records(fault_free_dirs["log_dir"])
    assert sorted((p["step"], p["rank"]) for p in records) == [(s, r) for s in range(1, STEPS + 1) for r in (0, 1)]
    for step in range(1, STEPS + 1):
        a, b = (p["ids"] for p in records if p["step"] == step)
        assert len(a) == len(b) == PER_DEVICE_BATCH and not set(a) & set(b)
    assert_every_epoch_sees_every_sample_once(records)
    # The Trainer saw the run's world, and neither train() nor end() touched the run's process group.
    ends = [p for p in read_progress(fault_free_dirs["log_dir"]) if "group_kept" in p]
    assert sorted(p["rank"] for p in ends) == [0, 1]
    assert all(p["group_kept"] and p["hf_world"] == 2 for p in ends)


@pytest.mark.timeout(180)
def test_sigkill_mid_epoch_recovers_in_place_exactly(local_ray, run_dirs, fault_free_dirs):
    """Rank 1 SIGKILLs itself as step 10 begins (the 4th of epoch 1; last report at step 8). The
    survivor goes on alone in its process from the checkpoint in memory, mid-epoch, and the run
    grows back to 2 once a replacement worker is placed (steps alone are slower: its 8 steps leave
    the replacement 12 s to start; no warm spare, which would be that replacement at the loss if it were
    ready); it ends with the fault-free run's parameters."""
    reference = model_state(fault_free_run(fault_free_dirs["log_dir"], fault_free_dirs["storage"]).checkpoint)
    kill_step = 10
    result = make_trainer(run_dirs, (1, 2), report_loop, epochs=EPOCHS, save_steps=SAVE_STEPS,
                          prepare={"global_batch_size": GLOBAL_BATCH}, step_time=0.1, step_time_alone=1.5,
                          fault={"kind": "kill", "rank": 1, "at_step": kill_step},
                          elastic=et.ElasticConfig(warm_spares_per_node=0)).fit()
    assert result.metrics["step"] == STEPS
    fault = json.loads(Path(run_dirs["log_dir"], "fault.json").read_text())
    # Resumed from memory at world 1, then grew back to 2; losing a worker was not a failure.
    resumed = [e for e in result.events if e["kind"] == "generation" and e.get("resume_from")]
    assert resumed[0]["resume_from"] == "memory" and resumed[0]["world_size"] == 1
    assert result.world_sizes[:2] == [2, 1] and result.world_sizes[-1] == 2
    assert not [e for e in result.events if e["kind"] == "failure"]
    records = step_records(run_dirs["log_dir"])
    # The survivor kept its process through every generation.
    survivor = {p["pid"] for p in records if p["generation"] == 0} - {fault["pid"]}
    assert len(survivor) == 1 and survivor <= {p["pid"] for p in records if p["generation"] == max(
        q["generation"] for q in records)}
    # Steps redone: those run again after the kill, at most the report interval.
    last = {}
    for p in records:
        last[p["step"]] = max(last.get(p["step"], -1), p["generation"])
    redone = {p["step"] for p in records if p["generation"] < last[p["step"]]}
    assert redone and len(redone) <= SAVE_STEPS, redone
    assert_every_epoch_sees_every_sample_once(records)
    # Accelerate's process-wide state was the generation's own in every generation (reset at its start).
    starts = [p for p in read_progress(run_dirs["log_dir"]) if "accelerate" in p]
    assert len(starts) == sum(result.world_sizes)
    assert all(p["accelerate"] == [p["rank"], p["world"]] for p in starts), starts
    # The same trajectory as the fault-free run, up to the order DDP sums in.
    state = model_state(result.checkpoint)
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.allclose(state[name], value, rtol=1e-4, atol=1e-5), (name, (state[name] - value).abs().max())
    alone = [p["time"] for p in records if p["world"] == 1]
    print("kill -> first step alone: %.3f s; steps redone: %s; world sizes: %s"
          % (min(alone) - fault["time"], sorted(redone), result.world_sizes))


@pytest.mark.timeout(30)
def test_transformers_trainer_checks_the_loop_like_torch_trainer():
    with pytest.raises(et.ConfigError, match="takes no argument"):
        TransformersTrainer(lambda: None, train_loop_config={"lr": 1e-3})
    trainer = TransformersTrainer(seed_train_func, train_loop_config={"log_dir": "/nowhere"})
    restored = TransformersTrainer(trainer.train_loop_per_worker)
    assert restored.train_loop_per_worker is trainer.train_loop_per_worker  # `restore()` does not wrap twice


@pytest.mark.timeout(30)
def test_ray_transformers_names_before_2_7():
    from elastic_train.huggingface import transformers as hf

    assert hf.TransformersTrainer is TransformersTrainer  # where Ray 2.x had it too
    for removed in ("TransformersCheckpoint", "TransformersPredictor"):
        with pytest.raises(et.UnsupportedAPIError, match="Ray removed it"):
            getattr(hf, removed)


@pytest.mark.timeout(120)
def test_seed_transformers_trainer_runs_on_two_workers(local_ray, run_dirs):
    """The seed's loop, unchanged: the Trainer trains distributed at the run's world size, in the run's
    working directory (so "./output" is the run's own)."""
    trainer = TransformersTrainer(
        seed_train_func, train_loop_config={"log_dir": run_dirs["log_dir"]},
        scaling_config=et.ScalingConfig(num_workers=2),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name="seed"),
    )
    trainer.fit()
    records = read_progress(run_dirs["log_dir"])
    assert sorted((p["rank"], p["process_index"], p["hf_world"]) for p in records) == [(0, 0, 2), (1, 1, 2)]
    assert {p["global_step"] for p in records} == {SAMPLES // 16}  # 8 per device on 2 workers
    (working_dir,) = {p["cwd"] for p in records}
    try:
        assert Path(working_dir).parent == Path(tempfile.gettempdir(), "elastic_train", "working_dirs")
        assert Path(working_dir).name.startswith("seed_") and working_dir != os.getcwd()
        assert {tuple(p["saved"]) for p in records} == {(f"checkpoint-{SAMPLES // 16}",)}
        assert HF_FILES <= set(os.listdir(Path(working_dir, "output", f"checkpoint-{SAMPLES // 16}")))
    finally:
        shutil.rmtree(working_dir, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_trainer_sharded_with_fsdp_is_refused_with_the_fix(local_ray, run_dirs):
    """Accelerate writes an FSDP checkpoint's shards on every rank, and the integration collects process
    zero's files: a resume would load a partial state, so prepare_trainer refuses it, naming what works."""
    trainer = TransformersTrainer(
        report_loop, train_loop_config={"log_dir": run_dirs["log_dir"], "epochs": 1, "save_steps": 2,
                                        "args": {"fsdp": "full_shard"}},
        scaling_config=et.ScalingConfig(num_workers=1),
        run_config=et.RunConfig(storage_path=run_dirs["storage"], name="fsdp"),
    )
    with pytest.raises(et.TrainingFailedError, match="TrainingArguments\\(fsdp=.*parallel_strategy='fsdp'"):
        trainer.fit()

