"""report()'s barrier (worker/report/barrier.py): which reports may leave before it passes, and the
all-reduce itself on real gloo ranks (one process each): issued without waiting, read when the
next report waits for it or by a callback as it completes, failing when a peer is gone."""

from __future__ import annotations

import os
import threading
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.worker.report.barrier import Agreed, all_wait, goes_on, issue
from tests.helpers import run_gloo_ranks

TIMEOUT_S = 20.0
PLAIN = Agreed(checkpoint=False, unwind=False, every_part=False, store_live=False)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("previous, plain, unwind_due, pipelined, expected", [
    (PLAIN, True, False, True, True),  # metrics (or a kept state) after the same: on at once
    (None, True, False, True, False),  # a generation's first report: no rank knows a previous one
    (PLAIN, False, False, True, False),  # a checkpoint: decided now
    (PLAIN, True, True, True, False),  # asked to unwind: waits, and tells the others at the next report
    (PLAIN, True, False, False, False),  # NCCL, or a group of one: every report waits
    (Agreed(True, False, False, False), True, False, True, False),  # a peer's checkpoint before
    (Agreed(False, True, False, False), True, False, True, False),  # a peer's unwind before
    (Agreed(False, False, False, True, True), True, False, True, False),  # a peer's live part due
    (Agreed(False, False, True, False, True), True, False, True, False),  # every rank's part
])
def test_which_reports_go_on_before_their_barrier(previous, plain, unwind_due, pipelined, expected):
    assert goes_on(plain, unwind_due, previous, pipelined) is expected


@pytest.mark.timeout(10)
def test_every_rank_waits_at_once_after_a_notable_report_or_where_none_goes_on():
    assert all_wait(None, True)
    assert not all_wait(PLAIN, True)
    assert all_wait(PLAIN, False)  # NCCL, or alone: no rank ever went on
    assert all_wait(PLAIN, True, unwind_alike=True)  # every rank's loop saw the same notice: none goes on
    assert all_wait(Agreed(checkpoint=True, unwind=False, every_part=False, store_live=False), True)
    assert all_wait(Agreed(checkpoint=False, unwind=False, every_part=False, store_live=False, some_part=True), True)


def _rank_main(rank: int, port: int, case: str, peer: Any, conn: Any) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=TIMEOUT_S))
        if rank == 0:  # goes on: issues, never waits for the all-reduce, learns it from the callback
            agreement = issue(False, False, False, False)
            passed: list[Agreed] = []
            done = threading.Event()
            agreement.on_passed(lambda agreed: (passed.append(agreed), done.set()))
            peer.send("issued")  # rank 1 issues only now: an issue that waited would never get here
            if case == "passed":
                done.wait(TIMEOUT_S)
                conn.send({"passed": passed, "result": agreement.result()})
            else:
                try:
                    agreement.result()
                    conn.send({"error": "the all-reduce passed without its peer"})
                except Exception as exc:  # noqa: BLE001 - what the test expects
                    conn.send({"raised": type(exc).__name__, "passed": passed})
        else:
            assert peer.recv() == "issued"
            if case == "peer_gone":
                conn.send({})
                os._exit(0)  # its connections close with it, its share never sent
            conn.send({"result": issue(True, False, True, False).result()})  # a checkpoint part: waits at once
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


def _run(case: str) -> list[dict]:
    receive, send = mp.get_context("spawn").Pipe(duplex=False)  # rank 0 tells rank 1 it issued
    return run_gloo_ranks(_rank_main, 2, lambda rank: (case, send if rank == 0 else receive), TIMEOUT_S * 2)


@pytest.mark.timeout(90)
def test_a_report_that_goes_on_learns_a_peers_checkpoint_as_its_barrier_passes():
    """Rank 0 reports plainly and goes on; rank 1, which issues only after that, reports a checkpoint
    part and waits. Both read the same agreement, rank 0 from the callback that sends its report to
    the supervisor (urgently: rank 1's round trip waits for it), and both learn that rank 1 alone
    holds a part (a survivor's report tells the supervisor so)."""
    going_on, waiting = _run("passed")
    assert "error" not in going_on and "error" not in waiting, (going_on, waiting)
    expected = Agreed(checkpoint=True, unwind=False, every_part=False, store_live=False, some_part=True,
                      part_ranks=(1,), sends=(0, 0))  # neither sends its buddy a part (worker/report/part_exchange.py)
    assert going_on["passed"] == [expected] and going_on["result"] == expected
    assert waiting["result"] == expected and expected.round_trip and expected.notable


@pytest.mark.timeout(90)
def test_a_report_that_went_on_fails_at_the_next_wait_when_its_peer_is_gone():
    """The peer died before making the report: the barrier fails where it is awaited, and the
    callback (which would send the report as made by every rank) never runs."""
    going_on, _ = _run("peer_gone")
    assert "error" not in going_on, going_on
    assert going_on["raised"] and going_on["passed"] == [], going_on
