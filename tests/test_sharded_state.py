"""A sharded model's kept state (worker/hold/sharded_state.py) and `prepare_model`'s FSDP keywords
(torch/fsdp.py), on real gloo ranks, one process each, no Ray: a transformer block stack sharded with
FSDP2 at 3 ranks, with AdamW and an LR scheduler, re-sharded from its ranks' shares to 2, 1 and 4
ranks equals the state it was, bit for bit; each new rank reads only the shares that hold its rows.
"""

from __future__ import annotations

import functools
import io
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor

from elastic_train.checkpoint.checkpoint import share_file
from elastic_train.protocol import HeldCheckpoint
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.torch.fsdp import fsdp_arguments, shard
from elastic_train.worker.hold.holdings import Holdings
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.hold.parts import HeldParts
from elastic_train.worker.hold.sharded_state import is_sharded, local_copy, needed, reshard
from elastic_train.worker.report.share_copies import ShareCadence
from tests.test_process_group import TIMEOUT_S, _run

SHARES = "ELASTIC_TRAIN_TEST_SHARES"  # where the 3-rank run's shares are, for the re-sharding ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=24, dropout=0.0, batch_first=True)
              for _ in range(3)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 5))


def _init(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))


def _sharded(rank: int, world: int, port: int):
    _init(rank, world, port)
    model = shard(_model(), {"auto_wrap_policy": ModuleWrapPolicy({torch.nn.TransformerEncoderLayer})},
                  torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, gathered whole (a collective)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().full_tensor()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = optimizer.state[p][key].full_tensor()
    return out


def _train_at_3(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    model, optimizer, scheduler = _sharded(rank, world, ports[0])
    assert is_sharded(model)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 6, 16, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    state = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()], "objects": [scheduler.state_dict()]}
    return _saved({"share": local_copy(state, rank), "whole": _whole(model, optimizer), "lr": scheduler.get_last_lr()})


def _saved(result: dict) -> dict:
    """A rank's result as bytes (tensors sent over a pipe would be shared memory of a process gone)."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return {"saved": buffer.getvalue()}


def _results(scenario, world: int) -> list[dict]:
    return [torch.load(io.BytesIO(r["saved"]), weights_only=True) for r in _run(scenario, world)]


def _resharded(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    shares = torch.load(os.environ[SHARES], weights_only=True)
    model, optimizer, scheduler = _sharded(rank, world, ports[0])
    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    wanted = needed(model, len(shares))
    state = reshard({r: shares[r] for r in wanted}, mesh)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizers"][0])
    scheduler.load_state_dict(state["objects"][0])
    return _saved({"wanted": wanted, "whole": _whole(model, optimizer), "lr": scheduler.get_last_lr()})


@pytest.mark.timeout(180)
def test_shares_of_3_ranks_reshard_to_2_1_and_4_bit_for_bit(tmp_path: Path):
    trained = _results(_train_at_3, 3)
    path = tmp_path / "shares.pt"
    torch.save({r: result["share"] for r, result in enumerate(trained)}, path)
    expected = trained[0]["whole"]
    os.environ[SHARES] = str(path)
    try:
        for world, wanted in ((2, [[0, 1], [1, 2]]), (1, [[0, 1, 2]]), (4, [[0], [0, 1], [1, 2], [2]])):
            results = _results(_resharded, world)
            assert [r["wanted"] for r in results] == wanted, world
            for result in results:
                assert result["lr"] == trained[0]["lr"]
                assert result["whole"].keys() == expected.keys()
                for key, value in expected.items():
                    assert torch.equal(result["whole"][key], value), f"world {world}: {key}"
    finally:
        del os.environ[SHARES]


# -- prepare_model's FSDP keywords (no process group) -------------------------------------------------------
@pytest.mark.timeout(30)
def test_fsdp1_keywords_translate_to_fully_shard():
    plan = fsdp_arguments({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "device_id": 0, "use_orig_params": True,
                           "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                           "cpu_offload": CPUOffload(offload_params=True), "sync_module_states": True,
                           "limit_all_gathers": True, "forward_prefetch": True})
    assert plan.shard_kwargs["reshard_after_forward"] is False
    assert plan.shard_kwargs["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert type(plan.shard_kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"
    assert plan.sync_module_states and plan.units is None
    assert fsdp_arguments({"sharding_strategy": "FULL_SHARD"}).shard_kwargs == {"reshard_after_forward": True}
    assert fsdp_arguments({"reshard_after_forward": False}).shard_kwargs == {"reshard_after_forward": False}


@pytest.mark.timeout(30)
def test_auto_wrap_policies_choose_the_units_fsdp1_would_wrap():
    model = _model()
    layers = list(model)[:3]
    by_class = fsdp_arguments({"auto_wrap_policy": ModuleWrapPolicy({torch.nn.TransformerEncoderLayer})}).units
    assert by_class(model, ()) == list(reversed(layers))
    by_size = fsdp_arguments({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy,
                                                                    min_num_params=1000)}).units
    chosen = by_size(model, ())
    assert chosen and all(sum(p.numel() for p in m.parameters()) >= 1000 for m in chosen)
    assert model not in chosen
    # FSDP1 never descends into a MultiheadAttention (its forward reads out_proj's weight directly).
    inside = {id(m) for mha in model.modules() if isinstance(mha, torch.nn.MultiheadAttention) for m in mha.modules()
              if m is not mha}
    assert not any(id(m) in inside for m in chosen)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, says", [
    ({"sharding_strategy": ShardingStrategy.NO_SHARD}, "parallel_strategy='ddp'"),
    ({"sharding_strategy": ShardingStrategy.HYBRID_SHARD}, "FULL_SHARD"),
    ({"process_group": None}, "builds each generation's process group"),
    ({"mesh": None}, "builds each generation's process group"),
    ({"param_init_fn": None}, "meta device"),
    ({"mixed_precision": MixedPrecision(buffer_dtype=torch.float16)}, "keeps buffers"),
    ({"sharding": 1}, "unknown keyword 'sharding'"),
])
def test_fsdp_keywords_that_cannot_mean_the_same_are_refused_with_the_fix(kwargs, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        fsdp_arguments(kwargs)


# -- the supervisor's view of the shares (no Ray) -----------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_report_of_shares_is_resumed_from_only_where_every_ranks_share_is_held():
    """3 ranks (workers 10, 11, 12; each one's buddy the next). Report 7: workers 10 and 12 reported
    their shares; worker 11 died with its report on the way, but its share reached its buddy (12). Once
    the generation closes, report 7 is whole and served from 10 and 12; report 8, whose share of rank 1
    no survivor holds, is not."""
    ledger = CheckpointLedger(keep=2)
    for index in (7, 8):
        for rank, worker in ((0, 10), (2, 12)):
            ledger.record(0, 3, index, rank, worker, [share_file(rank)], {"step": index}, [])
        ledger.record_replica(0, index, 10, [share_file(2)], 3)
    ledger.record_replica(0, 7, 12, [share_file(1)], 3)
    assert ledger.resume_plan({10, 12}) is None  # not closed: rank 1's report may still come
    ledger.close(0)
    plan = ledger.resume_plan({10, 12})
    assert (plan.index, plan.state_only) == (7, True)
    assert plan.holders == {10: [share_file(0)], 12: [share_file(1), share_file(2)]}
    assert ledger.resume_plan({10}) is None  # rank 1's share went with worker 12


@pytest.mark.timeout(30)
def test_a_share_is_copied_when_its_cost_fits_the_budget_and_its_last_copy_reached_the_buddy():
    cadence = ShareCadence(budget=0.05)
    assert cadence.due(100.0, None)  # the generation's first report
    cadence.copied(100.0, copy_s=0.01, replication_s=None)
    assert not cadence.due(100.5, None)  # on its way to the buddy
    assert not cadence.due(100.5, 0.04)  # (0.01 + 0.04) / 0.05: 1 s between copies
    assert cadence.due(101.0, 0.04)
    # A slow copy (the first to a buddy sets up the connection) does not hold the next one back: the
    # lower of the last two copies' costs counts.
    cadence.copied(101.0, copy_s=0.01, replication_s=0.04)
    assert cadence.due(102.0, 0.39)  # 0.4 s, but the copy before cost 0.05
    cadence.copied(102.0, copy_s=0.01, replication_s=0.39)
    assert not cadence.due(103.0, 0.39) and cadence.due(110.0, 0.39)  # two slow copies in a row: 8 s
    every = ShareCadence(budget=1.0)
    every.copied(0.0, copy_s=0.01, replication_s=None)
    assert every.due(0.07, 0.05) and not every.due(0.07, None)


@pytest.mark.timeout(30)
def test_a_resumed_generation_drops_the_later_reports_it_redoes():
    """Held: reports 10 and 11 of generation 1; the next generation resumes from 10 (11 was not whole).
    11 is dropped, so the new generation's first copy pushes out nothing it may still resume from."""
    memory = HeldParts(keep=2)
    for index in (10, 11):
        memory.put(HeldCheckpoint(index, 1, 0, [share_file(0)], []), {share_file(0): b"share"})
    memory.forget_after(1, 10)
    memory.put(HeldCheckpoint(1, 2, 0, [share_file(0)], []), {share_file(0): b"newer"})
    assert memory.keys() == [(1, 10), (2, 1)]


@pytest.mark.timeout(30)
def test_a_buddy_keeps_one_share_of_its_peer_once_every_ranks_newer_share_reached_its_buddy():
    """Ranks 0 and 1 of generation 1, each the other's buddy, copy their shares at reports 1-4. A
    buddy holds the peer's older share until the report after a newer one agrees that every rank's
    copy arrived (`replicated`): then one share of its peer at rest, and each report stays whole
    where a rank or its buddy survives. A replica from a generation that is over gives way only to a
    replicated copy of the running one; a parked worker drops nothing."""
    holdings = [Holdings(2, lambda peer, held, files: peer.hold_replica(held, files, running=True)) for _ in range(2)]
    try:
        def report(generation: int, index: int) -> None:
            for rank, mine in enumerate(holdings):
                share = LivePart({"w": torch.full((3,), float(index))}, file=share_file(rank), private=True)
                mine.hold(HeldCheckpoint(index, generation, rank, [share_file(rank)], []), share, None,
                          holdings[1 - rank])
            for mine in holdings:
                assert mine._replicator.flush(10.0)

        def replicas(rank: int) -> list[tuple[int, int]]:
            return holdings[rank].replicas.keys()

        report(1, 1)
        report(1, 2)
        assert replicas(0) == [(1, 1), (1, 2)]  # 2 is not yet known to have reached every buddy
        assert all(mine.share_delivered() for mine in holdings)  # what each rank tells the agreement
        for mine in holdings:
            mine.replicated(1)
        assert replicas(0) == replicas(1) == [(1, 2)]
        report(1, 3)  # arrives after 2 was agreed replicated: 2 stays until 3 is
        assert replicas(1) == [(1, 2), (1, 3)]
        assert holdings[1].replicas.get(1, 2, [share_file(0)])  # the peer's share of 2, readable
        holdings[0].replicated(2)  # an older generation's agreement never drops the running one's
        assert replicas(1) == [(1, 2), (1, 3)]
        holdings[1].replicated(1)
        assert replicas(1) == [(1, 3)] and holdings[1].own.keys() == [(1, 2), (1, 3)]  # own: the two newest
        # Generation 2 (rank 0 parked, then adopted): its first copy is held beside generation 1's
        # until every rank's has reached its buddy.
        holdings[1].hold_replica(HeldCheckpoint(4, 1, 0, [share_file(0)], []), {share_file(0): b"late"}, running=False)
        assert replicas(1) == [(1, 3), (1, 4)]  # parked: nothing dropped
        report(2, 5)  # running again: the newest two are kept
        assert replicas(1) == [(1, 4), (2, 5)]
        holdings[1].replicated(2)
        assert replicas(1) == [(2, 5)]
    finally:
        for mine in holdings:
            mine.close()


@pytest.mark.timeout(30)
def test_a_share_whose_copy_failed_is_not_delivered():
    """A copy that failed (the buddy unreachable, a timeout) tells the agreement its share did not reach
    the buddy: no buddy then drops its peer's older share on the strength of it."""
    def unreachable(peer, held, files):
        raise TimeoutError("the buddy did not answer")

    mine = Holdings(2, unreachable)
    try:
        share = LivePart({"w": torch.zeros(3)}, file=share_file(0), private=True)
        mine.hold(HeldCheckpoint(1, 1, 0, [share_file(0)], []), share, None, object())
        assert mine._replicator.flush(10.0)
        assert mine.replication_s() is not None and not mine.share_delivered()
    finally:
        mine.close()
