"""`report()` without a checkpoint waits for the ranks, not for the supervisor (worker/report/barrier.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from elastic_train.driver.launch import attach
from elastic_train.protocol import Report
from elastic_train.worker.report.sender import ReportSender
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import read_progress

FROZEN_S = 2.0  # below the heartbeat timeout: the supervisor, once thawed, finds every worker alive


@pytest.mark.timeout(120)
def test_reports_without_a_checkpoint_go_on_while_the_supervisor_is_frozen(local_ray, run_dirs):
    """The supervisor's process is SIGSTOPped for 2 s mid-run: the loop, which reports every step without
    a checkpoint, keeps stepping through it (each report is an all-reduce between the ranks, its metrics
    sent in the background); once thawed, the supervisor records every report and the run ends as a
    fault-free one would."""
    steps = 150
    join = fit_in_background(make_trainer(run_dirs, 2, steps=steps, step_time=0.03, checkpoints=False))
    wait_for(lambda: any(p["step"] >= 20 for p in read_progress(run_dirs["log_dir"])), 60, "step 20")
    pid = ray.get(attach("run").status.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        time.sleep(FROZEN_S)  # the fault's duration
    finally:
        os.kill(pid, signal.SIGCONT)
    thawed = time.time()
    result = join(90)

    assert result.error is None, result.error
    assert result.metrics["step"] == steps
    assert set(result.world_sizes) == {2} and not [e for e in result.events if e["kind"] == "worker_lost"]
    progress = read_progress(run_dirs["log_dir"])
    assert {p["step"] for p in progress if p["rank"] == 0} == set(range(1, steps + 1))
    frozen = sorted({p["step"] for p in progress if stopped + 0.5 < p["time"] < thawed})
    # ~50 steps fit in the 1.5 s window; a loop held by its reports would make none.
    assert len(frozen) >= 10, f"the loop made {len(frozen)} steps while the supervisor was frozen"
    # Every report reached the supervisor: its history holds each step once, in order.
    assert list(result.metrics_dataframe["step"]) == list(range(1, steps + 1))


def _report(index: int) -> Report:
    return Report(generation=0, index=index, metrics={"step": index}, names=None, loader_states=[])


@pytest.mark.timeout(30)
def test_the_sender_batches_reports_in_order_and_flush_waits_for_them():
    received: list[list[int]] = []
    gate = threading.Event()  # holds the first delivery, as a busy supervisor would

    def send(batch: list[Report]) -> None:
        gate.wait(10)
        received.append([r.index for r in batch])

    sender = ReportSender(send, interval_s=0.2)
    for i in range(1, 4):
        sender.submit(_report(i))
    assert not sender.flush(0.3), "flush returned before the supervisor received the reports"
    for i in range(4, 6):
        sender.submit(_report(i))
    gate.set()
    assert sender.flush(5)
    # Reports submitted within an interval travel together; a flush sends at once; order is kept.
    assert [i for batch in received for i in batch] == [1, 2, 3, 4, 5]
    assert len(received) == 2, received
    sender.submit(_report(6))
    sender.close()  # what is pending is still sent
    wait_for(lambda: received[-1] == [6], 5, "the last report")


@pytest.mark.timeout(30)
def test_a_batch_the_supervisor_cannot_take_is_dropped_and_later_reports_still_go():
    received: list[int] = []

    def send(batch: list[Report]) -> None:
        if batch[0].index == 1:
            raise ConnectionError("the supervisor is restarting")
        received.extend(r.index for r in batch)

    sender = ReportSender(send, interval_s=0.05)
    sender.submit(_report(1))
    assert sender.flush(5)  # given up, not waited for forever
    sender.submit(_report(2))
    assert sender.flush(5) and received == [2]
    sender.close()


@pytest.mark.timeout(30)
def test_an_urgent_report_is_sent_at_once_with_those_before_it():
    """A report a peer's round trip waits for (worker/report/barrier.py: sent as its barrier passes) does not
    wait out the batching interval, and the reports queued before it travel with it, in order."""
    received: list[list[int]] = []
    sender = ReportSender(lambda batch: received.append([r.index for r in batch]), interval_s=60)
    sender.submit(_report(1))
    sender.submit(_report(2), urgent=True)
    wait_for(lambda: received, 5, "the urgent report, well before the 60 s interval")
    assert received == [[1, 2]]
    sender.close()
