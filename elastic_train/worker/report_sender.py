"""Sends the reports that need no reply to the supervisor, batched, from a thread of its own.

A report at which no rank reported a checkpoint decides nothing at the supervisor (report()'s
barrier is the ranks' own all-reduce): its metrics, loader position and pace are only recorded. A
Ray call per report cost the loop ~1 ms here; this thread sends what the loop reported in the last
`ElasticConfig.report_interval_s` in one call, and waits for it to be received before sending the
next, so the supervisor records each worker's reports in order. `flush()` is for what must come
after them: a report with a checkpoint (the supervisor answers it), and leaving a generation.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elastic_train.protocol import Report

logger = logging.getLogger(__name__)


class ReportSender:
    def __init__(self, send: Callable[[list[Report]], None], interval_s: float):
        self._send = send  # delivers a batch; returns once the supervisor has recorded it
        self._interval_s = interval_s
        self._pending: list[Report] = []
        self._submitted = 0  # reports handed to this sender
        self._done = 0  # of those, reports sent (or given up)
        self._urgent = False  # a flush waits: send without waiting for the interval
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="elastic-train-reports")
        self._thread.start()

    def submit(self, report: Report, urgent: bool = False) -> None:
        """Queue `report`; `urgent`: send it now (a peer's round trip to the supervisor waits for it)."""
        with self._cond:
            wake = urgent or not self._pending  # otherwise the thread is batching, woken by its interval
            self._pending.append(report)
            self._submitted += 1
            self._urgent = self._urgent or urgent
            if wake:  # a thread switch per report would cost the loop more than the report itself
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every report submitted so far has been sent; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            if self._done >= target:
                return True
            self._urgent = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._done >= target, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Send what is pending, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                # Batch what the loop reports within the interval, unless a flush or close waits.
                self._cond.wait_for(lambda: self._urgent or self._closed, self._interval_s)
                batch, self._pending, self._urgent = self._pending, [], False
            try:
                self._send(batch)
            except Exception as exc:  # noqa: BLE001 - the supervisor is gone or restarting: metrics are lost, not the run
                logger.warning("%d report(s) of generation %d could not be sent to the supervisor: %s",
                               len(batch), batch[0].generation, exc)
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()
