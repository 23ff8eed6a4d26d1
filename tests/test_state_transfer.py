"""state_transfer.share on real gloo ranks (one process each): what the ranks that lack a state
receive is the holders' state, nest, dtypes, shapes and all."""

from __future__ import annotations

import io
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic_train.worker.hold.state_transfer import share
from tests.helpers import run_gloo_ranks

TIMEOUT_S = 30.0


def _state() -> dict[str, Any]:
    """A kept state's nest: a model's state dict (an OrderedDict with `_metadata`), an optimizer's
    (int keys, param groups), and tensors of every kind a state may hold."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict()],
        "odd": {"transposed": torch.arange(12.0).reshape(3, 4).t(), "flags": torch.tensor([True, False, True]),
                "empty": torch.zeros(0, 2), "half": torch.ones(3, dtype=torch.float16), "step": 7,
                "pair": (torch.tensor(1), "x"), "sparse": torch.eye(2).to_sparse()},
    }


def _rank_main(rank: int, port: int, world: int, holders: list[int], conn: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
        state = _state() if rank in holders else None
        received = share(state)
        out = io.BytesIO()  # not the tensors themselves: a pipe would share their memory with a process that ends
        torch.save({"same_object": received is state, "received": received,
                    "metadata": getattr(received["model"], "_metadata", None) if received else None}, out)
        conn.send(out.getvalue())
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


def _run(world: int, holders: list[int]) -> list[dict]:
    results = [torch.load(io.BytesIO(message), weights_only=False) if isinstance(message, bytes) else message
               for message in run_gloo_ranks(_rank_main, world, lambda rank: (world, holders), TIMEOUT_S * 2)]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


def _assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.layout) == (want.dtype, want.shape, want.layout)
        assert torch.equal(got.to_dense() if got.is_sparse else got, want.to_dense() if want.is_sparse else want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _assert_same(g, w)
    else:
        assert got == want


@pytest.mark.timeout(90)
def test_ranks_without_the_state_receive_the_holders():
    results = _run(world=3, holders=[1, 2])
    want = _state()
    for rank, result in enumerate(results):
        assert result["same_object"] is (rank in (1, 2)), "a holder's own state is what it gets back"
        _assert_same(result["received"], want)
    assert results[0]["metadata"] == want["model"]._metadata  # module versions, for load_state_dict


@pytest.mark.timeout(90)
def test_no_holder_gives_none_everywhere_and_all_holders_keep_their_own():
    assert [r["received"] for r in _run(world=2, holders=[])] == [None, None]
    assert all(r["same_object"] for r in _run(world=2, holders=[0, 1]))
