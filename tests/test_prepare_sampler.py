"""prepare_data_loader keeps the loader's sampling as Ray Train does (issue 49): which samplers shuffle,
a user's DistributedSampler's shuffle/seed/drop_last, and a warning for samplers it replaces."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from elastic_train.torch import data as data_module
from elastic_train.torch.data import ElasticBatchSampler, ElasticDataLoader, prepare_data_loader, sampling_of

SIZE = 20
DATASET = list(range(SIZE))


def _distributed(shuffle: bool = True, seed: int = 7, drop_last: bool = False) -> DistributedSampler:
    return DistributedSampler(DATASET, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=drop_last)


LOADERS = {
    "sequential": lambda: DataLoader(DATASET, batch_size=4),
    "random": lambda: DataLoader(DATASET, batch_size=4, shuffle=True),
    "distributed_shuffled": lambda: DataLoader(DATASET, batch_size=4, sampler=_distributed(True, 7, True)),
    "distributed_sequential": lambda: DataLoader(DATASET, batch_size=4, sampler=_distributed(False, 7, False)),
    "weighted": lambda: DataLoader(DATASET, batch_size=4, sampler=WeightedRandomSampler([1.0] * SIZE, SIZE)),
    "subset": lambda: DataLoader(DATASET, batch_size=4, sampler=SubsetRandomSampler(range(5))),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name, expected", [
    ("sequential", (False, 3, False)),
    ("random", (True, 3, False)),
    ("distributed_shuffled", (True, 7, True)),  # the sampler's seed wins over prepare_data_loader's
    ("distributed_sequential", (False, 7, False)),
    ("weighted", (True, 3, False)),  # Ray: replaced by DistributedSampler(shuffle=True)
    ("subset", (True, 3, False)),
])
def test_sampling_follows_ray_trains_rule(name, expected):
    assert sampling_of(LOADERS[name](), seed=3, warn=False) == expected


@pytest.mark.timeout(10)
def test_the_loaders_drop_last_is_kept_beside_a_distributed_samplers():
    loader = DataLoader(DATASET, batch_size=4, drop_last=True, sampler=_distributed(True, 7, False))
    assert sampling_of(loader, seed=0) == (True, 7, True)
    assert sampling_of(DataLoader(DATASET, batch_size=4, drop_last=True), seed=0) == (False, 0, True)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name, sampler_name", [("weighted", "WeightedRandomSampler"), ("subset", "SubsetRandomSampler")])
def test_a_replaced_sampler_is_named_in_a_warning(name, sampler_name, caplog):
    with caplog.at_level(logging.WARNING, logger=data_module.__name__):
        sampling_of(LOADERS[name](), seed=0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert sampler_name in warnings[0].getMessage() and "replaced" in warnings[0].getMessage()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["sequential", "random", "distributed_shuffled", "distributed_sequential"])
def test_a_kept_sampler_warns_nothing(name, caplog):
    with caplog.at_level(logging.WARNING, logger=data_module.__name__):
        sampling_of(LOADERS[name](), seed=0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_the_global_order_is_distributed_samplers(seed, epoch):
    ours = ElasticBatchSampler(SIZE, 4, 0, 1, shuffle=True, seed=seed, drop_last=False)
    ours.epoch = epoch
    theirs = _distributed(shuffle=True, seed=seed)
    theirs.set_epoch(epoch)
    assert ours.order().tolist() == list(theirs)
    assert [i for chunk in ours.chunks() for i in chunk] == list(theirs)


def _prepared(monkeypatch, loader: DataLoader, rank: int = 0, world: int = 2, seed: int = 0) -> ElasticDataLoader:
    """prepare_data_loader with a stand-in session: a world of `world` ranks, nothing to resume."""
    context = SimpleNamespace(get_world_size=lambda: world, get_world_rank=lambda: rank)
    session = SimpleNamespace(context=context, register_loader=lambda loader: None, resumes_kept_state=False)
    monkeypatch.setattr(data_module, "get_session", lambda caller: session)
    prepared = prepare_data_loader(loader, seed=seed)
    assert isinstance(prepared, ElasticDataLoader) and isinstance(prepared.batch_sampler, ElasticBatchSampler)
    return prepared


@pytest.mark.timeout(10)
def test_prepare_keeps_a_user_distributed_samplers_order_and_tail(monkeypatch):
    loader = DataLoader(DATASET, batch_size=3, sampler=_distributed(True, 7, True))
    shards = [_prepared(monkeypatch, loader, rank=rank, seed=123).batch_sampler for rank in range(2)]
    assert all((s.shuffle, s.seed, s.drop_last) == (True, 7, True) for s in shards)
    order = list(_distributed(shuffle=True, seed=7))
    assert [i for chunk in shards[0].chunks() for i in chunk] == order[:18]  # global batch 6: the tail of 2 dropped
    assert sorted(i for s in shards for batch in s for i in batch) == sorted(order[:18])


@pytest.mark.timeout(10)
def test_prepare_shuffles_a_weighted_sampler_over_the_whole_dataset_and_warns_once(monkeypatch, caplog):
    loader = LOADERS["weighted"]()
    with caplog.at_level(logging.WARNING, logger=data_module.__name__):
        shards = [_prepared(monkeypatch, loader, rank=rank, seed=4).batch_sampler for rank in range(2)]
    assert len([r for r in caplog.records if "WeightedRandomSampler" in r.getMessage()]) == 1  # rank 0 only
    assert all((s.shuffle, s.seed, s.drop_last) == (True, 4, False) for s in shards)
    expected = torch.randperm(SIZE, generator=torch.Generator().manual_seed(4)).tolist()
    assert shards[0].order().tolist() == expected


@pytest.mark.timeout(10)
def test_prepare_keeps_a_sequential_loader_in_order(monkeypatch):
    sampler = _prepared(monkeypatch, DataLoader(DATASET, batch_size=2, sampler=SequentialSampler(DATASET))).batch_sampler
    assert not sampler.shuffle and list(sampler.order()) == DATASET


class _Huge(torch.utils.data.Dataset):
    """A trillion samples, each its index: no list of its indices can be made."""

    def __len__(self) -> int:
        return 10**12

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.timeout(20)
def test_entering_an_epoch_makes_no_list_of_its_samples(monkeypatch):
    """Every recovery re-enters the loop, and with it the epoch: its indices were listed twice (the
    rest of the epoch, and its global batches), 0.3-0.4 s for the 1.2 million samples of the goodput
    benchmark, most of a recovery's time back to training. The rest of the epoch is now walked batch
    by batch, mid-epoch with owed samples too; a shuffled order is made once an epoch."""
    big = 10**12
    sampler = ElasticBatchSampler(big, 8, rank=1, world_size=2, shuffle=False, seed=0, drop_last=False)
    sampler.start, sampler.owed = 10**11, [3, 5, 7]
    chunks = sampler.chunks()
    assert next(chunks) == [3, 5, 7, *range(10**11, 10**11 + 5)]
    assert next(chunks) == list(range(10**11 + 5, 10**11 + 13))
    assert sampler.steps_left() == -(-(3 + big - 10**11) // 8)
    prepared = _prepared(monkeypatch, DataLoader(_Huge(), batch_size=4), rank=1)
    assert next(iter(prepared)).tolist() == [4, 5, 6, 7]
    shuffled = ElasticBatchSampler(10**6, 8, rank=0, world_size=1, shuffle=True, seed=3, drop_last=False)
    shuffled.start = 10**6 - 10
    assert [len(c) for c in shuffled.chunks()] == [8, 2] and shuffled.order() is shuffled.order()
