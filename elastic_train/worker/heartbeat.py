"""A thread that tells the supervisor this worker is alive, and learns when its generation ends.

The reply is how a survivor stuck in a collective learns that a peer is gone: it then aborts the
process group so the stuck operation fails and the loop can be re-entered in the next generation.
While Ray restarts the supervisor, heartbeats wait; if it is gone for good, the worker is told.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import psutil
import ray

from elastic_train.protocol import HeartbeatReply

logger = logging.getLogger(__name__)


class HeartbeatSender:
    def __init__(
        self,
        supervisor: Any,
        worker_id: int,
        interval_s: float,
        current_generation: Callable[[], int | None],
        on_generation_ended: Callable[[int], None],
        on_supervisor_gone: Callable[[], None],
    ):
        self._supervisor = supervisor
        self._worker_id = worker_id
        self._interval_s = interval_s
        self._current_generation = current_generation
        self._on_generation_ended = on_generation_ended
        self._on_supervisor_gone = on_supervisor_gone
        self._stop = threading.Event()
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent()  # prime the counter
        self._thread = threading.Thread(target=self._loop, name="elastic-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _facts(self) -> dict[str, float]:
        return {"rss_bytes": float(self._process.memory_info().rss), "cpu_percent": self._process.cpu_percent()}

    def _loop(self) -> None:
        pending: tuple[Any, int | None] | None = None  # the heartbeat in flight, and the generation it spoke for
        while not self._stop.wait(self._interval_s):
            if pending is None:
                generation = self._current_generation()
                pending = (self._supervisor.heartbeat.remote(self._worker_id, generation, self._facts()), generation)
            try:
                reply: HeartbeatReply = ray.get(pending[0], timeout=self._interval_s * 4)
            except ray.exceptions.GetTimeoutError:
                # The supervisor is busy, or being restarted (the call is retried on the new one). Wait for this
                # heartbeat rather than queue another behind it: a backlog would delay every worker's beats.
                continue
            except ray.exceptions.RayActorError:
                if not self._stop.is_set():
                    self._on_supervisor_gone()
                return
            generation, pending = pending[1], None
            if generation is not None and (reply.fenced or reply.active_generation != generation):
                self._on_generation_ended(generation)
