"""The usage in ../shared/seeds, as written for Ray Train, with only the imports changed.

`use_gpu=True` becomes `use_gpu=USE_GPU` (False on CPU machines) and worker counts fit 2 cores;
nothing else differs from the documents.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

# --- seed 000: "from ray.train.torch import TorchTrainer; from ray.train import ScalingConfig"
from elastic_train import ScalingConfig
from elastic_train.torch import TorchTrainer

# --- seed 001: "from ray import train"
import elastic_train as train

# --- seed 002: "import ray.train; from ray.train.torch import get_device, prepare_model, prepare_data_loader"
import elastic_train
from elastic_train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig
from elastic_train.torch import get_device, prepare_model, prepare_data_loader

USE_GPU = torch.cuda.is_available()


# seed 000 ---------------------------------------------------------------------------------------
class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 2)

    def forward(self, x):
        return self.linear(x)


def train_fn(config):
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    data_loader = [(torch.randn(16, 10), torch.randint(0, 2, (16,))) for _ in range(10)]
    for epoch in range(config.get("num_epochs", 1)):
        for inputs, labels in data_loader:
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
        print(f"Epoch {epoch + 1}, Loss: {loss.item()}")


def seed_000(storage):
    scaling_config = ScalingConfig(num_workers=2, use_gpu=USE_GPU)
    trainer = TorchTrainer(
        train_loop_per_worker=train_fn,
        train_loop_config={"num_epochs": 3},
        scaling_config=scaling_config,
        run_config=RunConfig(storage_path=storage),
    )
    return trainer.fit()


# seed 001 ---------------------------------------------------------------------------------------
def train_func(config):
    model = nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = train.torch.prepare_model(model)
    for epoch in range(10):
        output = model(torch.randn(32, 10))
        loss = output.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train.report({"loss": loss.item(), "epoch": epoch})


def seed_001(storage):
    trainer = TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=USE_GPU),
        run_config=RunConfig(storage_path=storage),
    )
    result = trainer.fit()
    print(f"Final loss: {result.metrics['loss']}")
    return result


# seed 002 ---------------------------------------------------------------------------------------
def build_model(config):
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def build_dataloader(config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], 4, generator=g)
    y = (x.sum(dim=1) > 0).long() + (x[:, 0] > 1).long()
    ids = torch.arange(config["samples"])
    return DataLoader(TensorDataset(x, y, ids), batch_size=8, shuffle=True)


def train_func_002(config):
    model = build_model(config)
    model = model.to(get_device())
    model = prepare_model(model)
    train_loader = build_dataloader(config)
    train_loader = prepare_data_loader(train_loader)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        running_loss = 0.0
        seen = []
        for batch in train_loader:
            inputs, targets, ids = batch
            inputs = inputs.to(get_device())
            targets = targets.to(get_device())
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = torch.nn.functional.cross_entropy(outputs, targets)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            seen += ids.tolist()
        with open(os.path.join(config["log_dir"], f"seen_{epoch}_{elastic_train.get_context().get_world_rank()}"), "w") as f:
            f.write(",".join(map(str, seen)))
        val_loss = config["val_losses"][epoch]
        elastic_train.report(
            {"loss": running_loss / len(train_loader), "epoch": epoch, "val_loss": val_loss},
            checkpoint=Checkpoint.from_dict({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
            }),
        )


def seed_002(storage, log_dir, val_losses):
    run_config = RunConfig(
        storage_path=storage,
        checkpoint_config=CheckpointConfig(
            num_to_keep=3,
            checkpoint_score_attribute="val_loss",
            checkpoint_score_order="min",
        ),
        failure_config=FailureConfig(max_failures=2),
    )
    scaling_config = ScalingConfig(num_workers=2, use_gpu=USE_GPU)
    trainer = TorchTrainer(
        train_loop_per_worker=train_func_002,
        train_loop_config={"lr": 1e-3, "epochs": len(val_losses), "samples": 64, "log_dir": log_dir,
                           "val_losses": val_losses},
        scaling_config=scaling_config,
        run_config=run_config,
    )
    return trainer.fit()
