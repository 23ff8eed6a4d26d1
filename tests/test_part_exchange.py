"""A small checkpoint part goes to its buddy inside the report (worker/report/part_exchange.py), on real gloo
ranks (one process each): the barrier's all-reduce tells every rank what each sends, each buddy
receives its peer's part with its report, stamped as its own barrier's; a large or dict-named part
is left to the background copy; a peer lost before sending fails the receiver's exchange."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic_train.checkpoint.checkpoint import DICT_FILE
from elastic_train.checkpoint.manifest import facts_soon, file_facts
from elastic_train.protocol import Report
from elastic_train.worker.report.barrier import agree
from elastic_train.worker.report.part_exchange import EXCHANGED_BYTES, PartExchange
from tests.helpers import run_gloo_ranks

TIMEOUT_S = 20.0
WORLD = 4
# By rank: the part each reports at index 7. Rank 1 none; rank 2 one too large to go in the report;
# rank 3 a dict checkpoint's (not copied where every rank holds one: left to the background copy).
PARTS: dict[int, dict[str, bytes] | None] = {
    0: {"model.pt": b"zero" * 1000, "extra/notes.txt": b"rank 0"},
    1: None,
    2: {"big.pt": b"2" * (EXCHANGED_BYTES + 1)},
    3: {DICT_FILE: b"three" * 10},
}


def _rank_main(rank: int, port: int, case: str, conn: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=TIMEOUT_S))
        held = []
        exchange = PartExchange(100 + rank, lambda h, files: held.append((h, files)))
        files = PARTS[rank] if case == "parts" else ({"model.pt": b"m"} if rank == 0 else None)
        report = Report(0, 7, {"loss": float(rank)}, sorted(files) if files else None, [{"epoch": 1}])
        payload = exchange.outgoing(report, files, facts_soon(files) if files else None, buddy_waits=True)
        agreed = agree(False, False, files is not None, False, sends=payload.numel() if payload is not None else 0)
        if case == "peer_gone" and rank == 0:
            conn.send({})
            os._exit(0)  # dies once the barrier passed, before its part went: its connections close with it
        report.generation, report.part_ranks = 3, list(agreed.part_ranks)  # as if agreed in a group re-formed in place
        went = exchange.exchange(agreed, report, payload)
        exchange.sent(report.index)
        conn.send({"sends": agreed.sends, "went": went, "peer": report.peer, "held": held})
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


@pytest.mark.timeout(120)
def test_each_small_part_goes_to_the_next_rank_with_its_report_stamped_as_the_receivers_barrier():
    results = run_gloo_ranks(_rank_main, WORLD, lambda rank: ("parts",), TIMEOUT_S * 2)
    assert not [r for r in results if "error" in r], results
    sizes = results[0]["sends"]
    assert all(r["sends"] == sizes for r in results)  # every rank knows what each sends
    assert sizes[0] > 0 and sizes[1:] == (0, 0, 0), sizes
    assert [r["went"] for r in results] == [True, False, False, False]
    # Rank 1 keeps rank 0's part as a replica, and brings its report: rank 0's metrics, its files' facts,
    # stamped with the receiver's generation and the barrier's part holders, and rank 0's rank and worker.
    peer = results[1]["peer"]
    assert peer.worker_id == 100 and peer.rank == 0 and peer.facts == file_facts(PARTS[0])
    assert (peer.report.generation, peer.report.index, peer.report.metrics) == (3, 7, {"loss": 0.0})
    assert peer.report.part_ranks == [0, 2, 3] and peer.report.loader_states == [{"epoch": 1}]
    [(held, files)] = results[1]["held"]
    assert (held.index, held.generation, held.rank, held.names) == (7, 3, 0, sorted(PARTS[0]))
    assert files == PARTS[0] and held.facts == file_facts(PARTS[0])
    # No one else received: rank 2's part is too large, rank 3's is named as a dict checkpoint's.
    assert [r["peer"] for r in results] == [None, peer, None, None]
    assert [r["held"] for r in results[2:] + results[:1]] == [[], [], []]


@pytest.mark.timeout(120)
def test_a_buddy_whose_peer_is_lost_before_its_part_came_goes_on_without_it():
    """Rank 0 dies once the barrier passed, before sending its part: its buddy's receive fails (the
    connection closed) rather than waiting, and the report goes on holding nothing of rank 0's (the
    generation is over: the next collective says so). Rank 0's part is then lost with it, as a
    background copy would have been."""
    results = run_gloo_ranks(_rank_main, WORLD, lambda rank: ("peer_gone",), TIMEOUT_S * 2)
    assert results[0] == {}
    buddy = results[1]
    assert "error" not in buddy, buddy
    assert buddy["sends"][0] > 0 and not buddy["went"] and buddy["peer"] is None and buddy["held"] == []
