"""Ray Train's own examples fed by Ray Data, ported by the import rule alone (`ray.train` ->
`elastic_train`): the TorchTrainer docstring's (ray/train/v2/torch/torch_trainer.py) and
torch_regression_example.py's loop (ray/train/examples/pytorch/), its CSV read from a local file."""

from __future__ import annotations

import os
import tempfile

import pandas as pd
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import ray
import elastic_train  # was: import ray.train
import elastic_train as train  # was: import ray.train as train
from elastic_train import Checkpoint, DataConfig, ScalingConfig  # was: from ray.train import ...
from elastic_train.torch import TorchTrainer  # was: from ray.train.torch import TorchTrainer


# -- the TorchTrainer docstring's example ------------------------------------------------------------
class NeuralNetwork(nn.Module):
    def __init__(self):
        super(NeuralNetwork, self).__init__()
        self.layer1 = nn.Linear(1, 32)
        self.relu = nn.ReLU()
        self.layer2 = nn.Linear(32, 1)

    def forward(self, input):
        return self.layer2(self.relu(self.layer1(input)))


def train_fn_per_worker(config):
    lr = config["lr"]
    batch_size = config["batch_size"]
    num_epochs = config["num_epochs"]
    train_dataset_shard = elastic_train.get_dataset_shard("train")
    model = NeuralNetwork()
    model = elastic_train.torch.prepare_model(model)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataloader = train_dataset_shard.iter_torch_batches(batch_size=batch_size, dtypes=torch.float)
    for epoch in range(num_epochs):
        for batch in dataloader:
            output = model(batch["input"])
            loss = loss_fn(output, batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        base_model = model.module if isinstance(model, DistributedDataParallel) else model
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            torch.save({"model_state_dict": base_model.state_dict()}, os.path.join(temp_checkpoint_dir, "model.pt"))
            checkpoint = elastic_train.Checkpoint.from_directory(temp_checkpoint_dir)
            elastic_train.report({"loss": loss.item()}, checkpoint=checkpoint)


def docstring_trainer(run_config, num_workers=2, use_gpu=False):
    train_dataset = ray.data.from_items([{"input": [x], "label": [2 * x + 1]} for x in range(128)])
    return TorchTrainer(
        train_fn_per_worker,
        train_loop_config={"num_epochs": 1, "lr": 0.01, "batch_size": 32},
        scaling_config=elastic_train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        datasets={"train": train_dataset},
        run_config=run_config,
    )


# -- torch_regression_example.py -----------------------------------------------------------------------
def get_datasets(csv_path: str, split: float = 0.7):
    dataset = ray.data.read_csv(csv_path)  # was: "s3://anonymous@air-example-data/regression.csv"

    def combine_x(batch):
        return pd.DataFrame({"x": batch[[f"x{i:03d}" for i in range(100)]].values.tolist(), "y": batch["y"]})

    dataset = dataset.map_batches(combine_x, batch_format="pandas")
    train_dataset, validation_dataset = dataset.repartition(num_blocks=4).train_test_split(split, shuffle=True)
    return train_dataset, validation_dataset


def train_epoch(iterable_dataset, model, loss_fn, optimizer, device):
    model.train()
    for X, y in iterable_dataset:
        X = X.to(device)
        y = y.to(device)
        pred = model(X)
        loss = loss_fn(pred, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def validate_epoch(iterable_dataset, model, loss_fn, device):
    num_batches = 0
    model.eval()
    loss = 0
    with torch.no_grad():
        for X, y in iterable_dataset:
            X = X.to(device)
            y = y.to(device)
            num_batches += 1
            pred = model(X)
            loss += loss_fn(pred, y).item()
    loss /= num_batches
    return {"loss": loss}


def train_func(config):
    batch_size = config.get("batch_size", 32)
    hidden_size = config.get("hidden_size", 10)
    lr = config.get("lr", 1e-2)
    epochs = config.get("epochs", 3)
    train_dataset_shard = train.get_dataset_shard("train")
    validation_dataset = train.get_dataset_shard("validation")
    model = nn.Sequential(nn.Linear(100, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 1))
    model = train.torch.prepare_model(model)
    loss_fn = nn.L1Loss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    results = []

    def create_torch_iterator(shard):
        iterator = shard.iter_torch_batches(batch_size=batch_size)
        for batch in iterator:
            yield batch["x"].float(), batch["y"].float()

    for _ in range(epochs):
        train_torch_dataset = create_torch_iterator(train_dataset_shard)
        validation_torch_dataset = create_torch_iterator(validation_dataset)
        device = train.torch.get_device()
        train_epoch(train_torch_dataset, model, loss_fn, optimizer, device)
        if train.get_context().get_world_rank() == 0:
            result = validate_epoch(validation_torch_dataset, model, loss_fn, device)
        else:
            result = {}
        results.append(result)
        with tempfile.TemporaryDirectory() as tmpdir:
            torch.save(model.module.state_dict(), os.path.join(tmpdir, "model.pt"))
            train.report(result, checkpoint=Checkpoint.from_directory(tmpdir))
    return results


def regression_trainer(csv_path, run_config, num_workers=2, use_gpu=False):
    train_dataset, val_dataset = get_datasets(csv_path)
    config = {"lr": 1e-2, "hidden_size": 20, "batch_size": 4, "epochs": 3}
    return TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        datasets={"train": train_dataset, "validation": val_dataset},
        dataset_config=DataConfig(datasets_to_split=["train"]),
        run_config=run_config,
    )


def write_regression_csv(path: str, rows: int) -> None:
    """regression.csv's columns (x000..x099, y): y a noisy linear function of the x's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 100, generator=g)
    y = x @ torch.randn(100, 1, generator=g) + 0.1 * torch.randn(rows, 1, generator=g)
    frame = pd.DataFrame(x.numpy(), columns=[f"x{i:03d}" for i in range(100)])
    frame["y"] = y[:, 0].numpy()
    frame.to_csv(path, index=False)
