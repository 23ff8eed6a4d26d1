"""Training programs as users bring them, each holding something derived from its world, and what Ray
Train's semantics say each computes (tests/test_faithful_programs.py runs them under faults).

Every program trains a tiny DDP model (`prepare_model`) on the ids 0..N-1 from `prepare_data_loader`,
saves a checkpoint once an epoch (rank 0, unless said), and logs each step as tests/guide_loops.py
does (`drawn` before the step's backward, `batches` after it), so `completed_steps` gives the run's
lineage. Each records the value it holds beside the one its context answers now (`held`, `now`), as
logging does (a logged read is no read of the loop's). The checks (`CHECKS`) are what Ray Train
computes for the program at the world size each step ran at: the loop re-run at every new world.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import elastic_train as et
from elastic_train.torch import prepare_data_loader, prepare_model
from tests.guide_loops import completed_steps
from tests.loops import log_progress, read_progress

N, EPOCHS, GLOBAL, VALIDATION = 24, 4, 4, 8
STEP_TIME = 0.05


# == what every program shares: a model, a step, a checkpoint, the log =================================
def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(1, 1).double())
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    x = batch.double()[:, None] / N
    return ((model(x) - x) ** 2).mean()


def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, name: str = "state.pt") -> dict[str, Any]:
    """The checkpoint's own fields ({} for a fresh run), its model and optimizer loaded from file `name`."""
    checkpoint = et.get_checkpoint()
    if checkpoint is None:
        return {}
    with checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, name), weights_only=False)
    model.module.load_state_dict(state.pop("model"))
    optimizer.load_state_dict(state.pop("optimizer"))
    return state


def _report(model: torch.nn.Module, optimizer: torch.optim.Optimizer, save: bool, metrics: dict, **fields: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if save:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), **fields},
                       os.path.join(d, "state.pt"))
            checkpoint = et.Checkpoint.from_directory(d)
        et.report(metrics, checkpoint=checkpoint)


def _step(config: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int,
          batch: torch.Tensor, **logged: Any) -> torch.Tensor:
    """One training step, logged as guide_loops.py logs it, with what the program holds (`held=`)."""
    ctx = et.get_context()
    log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                 generation=ctx.get_generation(), epoch=epoch, step=step, drawn=[batch.tolist()])
    loss = _loss(model, batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    log_progress(config["log_dir"], rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                 generation=ctx.get_generation(), epoch=epoch, step=step, batches=[batch.tolist()],
                 lr=optimizer.param_groups[0]["lr"], **logged)
    time.sleep(config.get("step_time", STEP_TIME))
    return loss


def _samples() -> torch.Tensor:
    return torch.arange(N)


# == the programs ===================================================================================
def batch_from_world(config: dict) -> None:
    """`batch_size = global_batch // world_size` at the top of the loop (Ray's guides do this)."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    batch_size = GLOBAL // et.get_context().get_world_size()
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=batch_size, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch, held={"batch_size": batch_size})
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def rank_read_once(config: dict) -> None:
    """`rank = get_context().get_world_rank()` once at the top; `if rank == 0:` saves."""
    model, optimizer = _model()
    rank = et.get_context().get_world_rank()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch, held={"rank": rank})
        _report(model, optimizer, rank == 0, {"epoch": epoch}, epoch=epoch)


def torch_and_environment_reads(config: dict) -> None:
    """`dist.get_rank()`, `dist.get_world_size()`, `os.environ["RANK"]`, `["WORLD_SIZE"]` read at the top."""
    model, optimizer = _model()
    rank, world = dist.get_rank(), dist.get_world_size()
    env_rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch,
                  held={"rank": rank, "world": world, "env_rank": env_rank, "env_world": env_world})
        _report(model, optimizer, rank == 0, {"epoch": epoch}, epoch=epoch)


def own_validation_sampler(config: dict) -> None:
    """A validation loader with its own `DistributedSampler(num_replicas=ws, rank=r)` beside a prepared
    training loader; the samples validated are all-reduced into the epoch's metric."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    ctx = et.get_context()
    validation = torch.arange(VALIDATION)
    sampler = DistributedSampler(validation, num_replicas=ctx.get_world_size(), rank=ctx.get_world_rank(), shuffle=False)
    validation_loader = DataLoader(validation, batch_size=2, sampler=sampler)
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
        seen = torch.zeros(1)
        for batch in validation_loader:
            seen += len(batch)
        dist.all_reduce(seen)
        log_progress(config["log_dir"], generation=ctx.get_generation(), epoch=epoch, validated=seen.item())
        _report(model, optimizer, ctx.get_world_rank() == 0, {"epoch": epoch, "validated": seen.item()}, epoch=epoch)


def _scheduled(config: dict, schedule: Callable[[torch.optim.Optimizer, int], Any]) -> None:
    """A scheduler sized by `EPOCHS * len(loader)`, stepped every step, saved with the checkpoint."""
    model, optimizer = _model()
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    scheduler = schedule(optimizer, EPOCHS * len(loader))
    state = _restore(model, optimizer)
    if state:
        scheduler.load_state_dict(state["scheduler"])
    for epoch in range(state.get("epoch", -1) + 1, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
            scheduler.step()
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch,
                scheduler=scheduler.state_dict())


def lambda_lr(config: dict) -> None:
    """`LambdaLR` decaying to 0 over `epochs * len(loader)` steps."""
    _scheduled(config, lambda optimizer, total: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total))


def one_cycle_lr(config: dict) -> None:
    """`OneCycleLR(total_steps=epochs * len(loader))`: it raises when stepped past its total."""
    _scheduled(config, lambda optimizer, total: torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total))


def all_reduce_of_a_world_share(config: dict) -> None:
    """`t = x / dist.get_world_size(); dist.all_reduce(t)`: a mean taken by hand each step (1.0)."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
            share = torch.ones(1) / dist.get_world_size()
            dist.all_reduce(share)
            log_progress(config["log_dir"], generation=et.get_context().get_generation(), epoch=epoch, mean=share.item())
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def shuffled_distributed_sampler(config: dict) -> None:
    """`prepare_data_loader` on a loader whose sampler is the user's `DistributedSampler(shuffle=True,
    seed=5)`, `set_epoch(epoch)` each epoch (Ray keeps that sampler)."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    data = _samples()
    loader = prepare_data_loader(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, shuffle=True, seed=5)))
    for epoch in range(start, EPOCHS):
        loader.sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def own_fast_forward(config: dict) -> None:
    """A checkpoint every 3 steps, mid-epoch too; resumed, the loop skips the steps its epoch did
    (`if epoch == start and i < skip: continue`). A fixed global batch: the steps of an epoch are
    the same at any world size."""
    model, optimizer = _model()
    state = _restore(model, optimizer)
    start, skip = state.get("epoch", 0), state.get("next_step", 0)
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True), global_batch_size=GLOBAL)
    for epoch in range(start, EPOCHS):
        for i, batch in enumerate(loader):
            if epoch == start and i < skip:
                continue
            _step(config, model, optimizer, epoch, i, batch)
            if (i + 1) % 3 == 0:
                done = i + 1 == len(loader)
                _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch, "step": i},
                        epoch=epoch + 1 if done else epoch, next_step=0 if done else i + 1)


def global_step_checkpoints(config: dict) -> None:
    """Checkpoints by global step, every 3 (one at each epoch's last step); resumed, the epoch and the
    step within it come from the global step."""
    model, optimizer = _model()
    global_step = _restore(model, optimizer).get("global_step", 0)
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True), global_batch_size=GLOBAL)
    steps = len(loader)
    for epoch in range(global_step // steps, EPOCHS):
        for i, batch in enumerate(loader):
            if i < global_step - epoch * steps:
                continue
            _step(config, model, optimizer, epoch, i, batch)
            global_step += 1
            if global_step % 3 == 0:
                _report(model, optimizer, et.get_context().get_world_rank() == 0, {"global_step": global_step},
                        global_step=global_step)
    log_progress(config["log_dir"], generation=et.get_context().get_generation(), finished_at=global_step)


def per_rank_epoch_sums(config: dict) -> None:
    """Each rank sums its samples' ids over the epoch; the sums are all-reduced at its end (a metric)."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        total = torch.zeros(1, dtype=torch.float64)
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
            total += batch.sum()
        dist.all_reduce(total)
        log_progress(config["log_dir"], generation=et.get_context().get_generation(), epoch=epoch, total=total.item())
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def own_samples(step: int, rank: int) -> list[int]:
    """The samples rank `rank` draws itself at step `step` of an epoch (two a step)."""
    return [(step * GLOBAL + rank * 2 + j) % N for j in range(2)]


def rank_once_own_data(config: dict) -> None:
    """No prepared loader: `rank = get_context().get_world_rank()` once at the top, and each step draws
    the samples of that rank (`own_samples(step, rank)`); rank 0 saves."""
    model, optimizer = _model()
    rank = et.get_context().get_world_rank()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    for epoch in range(start, EPOCHS):
        for step in range(N // GLOBAL):
            _step(config, model, optimizer, epoch, step, torch.tensor(own_samples(step, rank)), held={"rank": rank})
        _report(model, optimizer, rank == 0, {"epoch": epoch}, epoch=epoch)


def rank_where_used(config: dict) -> None:
    """The ordinary loop: the rank read where it is used (`if get_context().get_world_rank() == 0:`)."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def every_rank_its_own_shard(config: dict) -> None:
    """Every rank saves its own shard (`shard_{rank}.pt`, the rank read once at the top) into each
    epoch's checkpoint; resumed, every rank loads the model from shard 0."""
    model, optimizer = _model()
    rank = et.get_context().get_world_rank()
    start = _restore(model, optimizer, "shard_0.pt").get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch, held={"rank": rank})
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                        "rank": rank}, os.path.join(d, f"shard_{rank}.pt"))
            et.report({"epoch": epoch}, checkpoint=et.Checkpoint.from_directory(d))


def metrics_all_reduced_by_hand(config: dict) -> None:
    """The world size read once at the top (`world = dist.get_world_size()`); each step a count
    all-reduced by hand and divided by it, a mean as DDP tutorials log one (1.0)."""
    model, optimizer = _model()
    world = dist.get_world_size()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    loader = prepare_data_loader(DataLoader(_samples(), batch_size=2, shuffle=True))
    for epoch in range(start, EPOCHS):
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch, held={"world": world})
            count = torch.ones(1)
            dist.all_reduce(count)
            log_progress(config["log_dir"], generation=et.get_context().get_generation(), epoch=epoch,
                         mean=(count / world).item())
        _report(model, optimizer, et.get_context().get_world_rank() == 0, {"epoch": epoch}, epoch=epoch)


def ddp_tutorial(config: dict) -> None:
    """PyTorch's DDP tutorial: its own `DistributedSampler(dataset, seed=5)` (its rank and world from
    the default group) and `DataLoader`, no `prepare_data_loader`; `sampler.set_epoch(epoch)`;
    `dist.get_rank() == 0` saves."""
    model, optimizer = _model()
    start = _restore(model, optimizer).get("epoch", -1) + 1
    data = _samples()
    sampler = DistributedSampler(data, shuffle=True, seed=5)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            _step(config, model, optimizer, epoch, step, batch)
        _report(model, optimizer, dist.get_rank() == 0, {"epoch": epoch}, epoch=epoch)


# == what Ray Train computes for each ===================================================================
def lineage(log_dir: str) -> list[dict]:
    """Each step of the run's lineage (guide_loops.py `completed_steps`), one record per rank."""
    return [r for records in completed_steps(log_dir).values() for r in records]


def every_sample_once_an_epoch(log_dir: str, result: et.Result) -> None:
    steps = completed_steps(log_dir)
    for epoch in range(EPOCHS):
        used = sorted(i for (e, _), records in steps.items() if e == epoch for r in records for b in r["batches"] for i in b)
        assert used == list(range(N)), f"epoch {epoch}: {used}"


def held_is_now(log_dir: str, result: et.Result) -> None:
    """What the loop holds of its place is what its context answers at every step it trains."""
    now = {"rank": "rank", "world": "world", "env_rank": "rank", "env_world": "world"}
    for r in lineage(log_dir):
        for name, value in r.get("held", {}).items():
            if name in now:
                assert value == r[now[name]], f"{name} held {value} at a step of rank {r['rank']}/{r['world']}: {r}"
        if "batch_size" in r.get("held", {}):
            assert r["held"]["batch_size"] == GLOBAL // r["world"], r


def its_own_samples(log_dir: str, result: et.Result) -> None:
    """Each step trained the samples of the rank that trained it: at world 1, rank 0's alone, as Ray
    Train's re-run at world 1 trains them."""
    for r in lineage(log_dir):
        assert r["batches"] == [own_samples(r["step"], r["rank"])], r


def a_checkpoint_every_epoch(log_dir: str, result: et.Result) -> None:
    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "state.pt"), weights_only=False)["epoch"] == EPOCHS - 1


def _last_per_epoch(log_dir: str, key: str) -> dict[int, float]:
    """The value `key` the run's last generation to end each epoch logged for it."""
    found: dict[int, tuple[int, float]] = {}
    for p in read_progress(log_dir):
        if key in p and p["generation"] >= found.get(p["epoch"], (-1, 0.0))[0]:
            found[p["epoch"]] = (p["generation"], p[key])
    return {epoch: value for epoch, (_, value) in found.items()}


def whole_validation(log_dir: str, result: et.Result) -> None:
    assert _last_per_epoch(log_dir, "validated") == {e: float(VALIDATION) for e in range(EPOCHS)}


def no_step_at_lr_0(log_dir: str, result: et.Result) -> None:
    assert all(r["lr"] > 0 for r in lineage(log_dir))


def means_of_one(log_dir: str, result: et.Result) -> None:
    means = [p["mean"] for p in read_progress(log_dir) if "mean" in p]
    assert means and all(abs(m - 1.0) < 1e-9 for m in means), means


def seeded_order(log_dir: str, result: et.Result) -> None:
    """Epoch 0's first global batch is the first of `DistributedSampler(seed=5)`'s order for epoch 0."""
    first = sorted(i for r in lineage(log_dir) if (r["epoch"], r["step"]) == (0, 0) for b in r["batches"] for i in b)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
    assert first == sorted(order[:len(first)]), (first, order)


def ends_at_the_last_global_step(log_dir: str, result: et.Result) -> None:
    finished = [p["finished_at"] for p in read_progress(log_dir) if "finished_at" in p]
    assert finished and set(finished) == {EPOCHS * (N // GLOBAL)}, finished


def shards_of_its_last_world(log_dir: str, result: et.Result) -> None:
    """The last checkpoint holds one shard per rank of the world its epoch ended at, each that rank's."""
    world = max((r for r in lineage(log_dir) if r["epoch"] == EPOCHS - 1), key=lambda r: r["generation"])["world"]
    with result.checkpoint.as_directory() as d:
        assert sorted(os.listdir(d)) == [f"shard_{r}.pt" for r in range(world)], os.listdir(d)
        for r in range(world):
            shard = torch.load(os.path.join(d, f"shard_{r}.pt"), weights_only=False)
            assert (shard["epoch"], shard["rank"]) == (EPOCHS - 1, r), shard


def whole_epoch_sums(log_dir: str, result: et.Result) -> None:
    assert _last_per_epoch(log_dir, "total") == {e: float(sum(range(N))) for e in range(EPOCHS)}


PROGRAMS: dict[str, tuple[Callable[[dict], None], tuple[Callable[[str, et.Result], None], ...]]] = {
    "batch_from_world": (batch_from_world, (held_is_now,)),
    "rank_read_once": (rank_read_once, (held_is_now, a_checkpoint_every_epoch)),
    "torch_and_environment_reads": (torch_and_environment_reads, (held_is_now, a_checkpoint_every_epoch)),
    "own_validation_sampler": (own_validation_sampler, (whole_validation,)),
    "lambda_lr": (lambda_lr, (no_step_at_lr_0,)),
    "one_cycle_lr": (one_cycle_lr, ()),
    "all_reduce_of_a_world_share": (all_reduce_of_a_world_share, (means_of_one,)),
    "shuffled_distributed_sampler": (shuffled_distributed_sampler, (seeded_order,)),
    "own_fast_forward": (own_fast_forward, ()),
    "global_step_checkpoints": (global_step_checkpoints, (ends_at_the_last_global_step,)),
    "per_rank_epoch_sums": (per_rank_epoch_sums, (whole_epoch_sums,)),
    "rank_where_used": (rank_where_used, (a_checkpoint_every_epoch,)),
    "rank_once_own_data": (rank_once_own_data, (held_is_now, its_own_samples, a_checkpoint_every_epoch)),
    "every_rank_its_own_shard": (every_rank_its_own_shard, (held_is_now, shards_of_its_last_world)),
    "metrics_all_reduced_by_hand": (metrics_all_reduced_by_hand, (held_is_now, means_of_one)),
    "ddp_tutorial": (ddp_tutorial, (seeded_order, a_checkpoint_every_epoch)),
}
OWN_DATA = {"rank_once_own_data"}  # no prepared loader: not every sample at every world size
