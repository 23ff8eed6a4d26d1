"""Sends the reports that need no reply to the supervisor, batched, from a thread of its own; and, in
the same stream, the parts stored after them (worker/store/worker_store.py).

A report at which no rank reported a checkpoint decides nothing at the supervisor (report()'s
barrier is the ranks' own all-reduce): its metrics, loader position and pace are only recorded. A
Ray call per report cost the loop ~1 ms here; this thread sends what the loop reported in the last
`ElasticConfig.report_interval_s` in one call, and waits for it to be received before sending the
next, so the supervisor records each worker's reports in order. `flush()` is for what must come
after them: a report with a checkpoint (the supervisor answers it), and leaving a generation.
"""

from __future__ import annotations

import logging
from typing import Callable

from elastic_train.protocol import PartStored, Report
from elastic_train.worker.background import BackgroundThread

logger = logging.getLogger(__name__)

Sent = Report | PartStored


class ReportSender(BackgroundThread[list[Sent]]):
    def __init__(self, send: Callable[[list[Sent]], None], interval_s: float):
        super().__init__("elastic-train-reports")
        self._send = send  # delivers a batch; returns once the supervisor has recorded it
        self._interval_s = interval_s
        self._pending: list[tuple[int, Sent]] = []  # (number, report or part stored)
        self._start()

    def submit(self, report: Sent, urgent: bool = False) -> None:
        """Queue `report`; `urgent`: send it now (a peer's round trip to the supervisor waits for it)."""
        with self._changed:
            # Otherwise the thread is batching, woken by its interval: a thread switch per report
            # would cost the loop more than the report itself.
            wake = urgent or not self._pending
            self._urgent = self._urgent or urgent
            self._pending.append((self._hand_over(wake=wake), report))

    def _waiting(self) -> bool:
        return bool(self._pending)

    def _take(self) -> tuple[list[Sent], list[int]]:
        # Batch what the loop reports within the interval, unless a flush or close waits.
        self._changed.wait_for(lambda: self._urgent or self._closed, self._interval_s)
        batch, self._pending, self._urgent = self._pending, [], False
        return [report for _, report in batch], [number for number, _ in batch]

    def _do(self, batch: list[Sent]) -> None:
        try:
            self._send(batch)
        except Exception as exc:  # noqa: BLE001 - the supervisor is gone or restarting: metrics are lost, not the run
            logger.warning("%d report(s) of generation %d could not be sent to the supervisor: %s",
                           len(batch), batch[0].generation, exc)
