"""A thread that tells the supervisor this worker is alive, and learns when its generation ends.

The reply is how a survivor stuck in a collective learns that a peer is gone: it then aborts the
process group so the stuck operation fails and the loop can be re-entered in the next generation.

Heartbeats go as UDP datagrams to the supervisor's endpoint (`supervisor/heartbeats.py`), which costs
it a fraction of what a Ray call does. A Ray call is the bootstrap (its reply names the endpoint) and
the fallback: when datagrams go unanswered for `heartbeat_reply_timeout_s` (UDP blocked, or Ray
restarted the supervisor on another port), the next heartbeat is a call, whose reply names the
current endpoint. While Ray restarts the supervisor, calls wait; if it is gone for good, the worker
is told.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

import psutil
import ray

from elastic_train.protocol import Beat, BeatReply, HeartbeatChannel, HeartbeatReply
from elastic_train.worker.resident import resident_bytes

logger = logging.getLogger(__name__)

_SEQS_KEPT = 8  # a reply to any of this many latest datagrams counts (a late one still proves the path)


class HeartbeatSender:
    def __init__(
        self,
        supervisor: Any,
        worker_id: int,
        node_id: str,
        interval_s: float,
        reply_timeout_s: float,
        current_generation: Callable[[], int | None],
        report_index: Callable[[int | None], int],
        on_generation_ended: Callable[[int], None],
        on_supervisor_gone: Callable[[], None],
    ):
        self._supervisor = supervisor
        self._worker_id = worker_id
        self._node_id = node_id
        self._interval_s = interval_s
        self._reply_timeout_s = reply_timeout_s
        self._current_generation = current_generation
        self._report_index = report_index  # the newest report the loop entered in a generation (-1: none)
        self._on_generation_ended = on_generation_ended
        self._on_supervisor_gone = on_supervisor_gone
        self._stop = threading.Event()
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent()  # prime the counter
        self._pending: tuple[Any, int | None] | None = None  # the Ray call in flight, and the generation it spoke for
        self._channel: HeartbeatChannel | None = None
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._seq = 0
        self._sent: OrderedDict[int, int | None] = OrderedDict()  # seq -> the generation that datagram spoke for
        self._answered = time.monotonic()  # the last reply, by either path
        self._udp_unanswered_noted = False
        self._thread = threading.Thread(target=self._loop, name="elastic-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._channel is None or time.monotonic() - self._answered > self._reply_timeout_s:
                    if self._channel is not None and not self._udp_unanswered_noted:
                        self._udp_unanswered_noted = True
                        logger.info("worker %d: no heartbeat reply over UDP for %.1fs; heartbeating through Ray",
                                    self._worker_id, self._reply_timeout_s)
                    if not self._call():
                        return
                    self._stop.wait(self._interval_s)
                else:
                    self._send()
                    self._receive_until(time.monotonic() + self._interval_s)
        finally:
            self._socket.close()

    # -- through Ray ----------------------------------------------------------------------------
    def _call(self) -> bool:
        """One heartbeat as a Ray call (one in flight at a time); False once the supervisor is gone for good."""
        if self._pending is None:
            generation = self._current_generation()
            self._pending = (self._supervisor.heartbeat.remote(self._worker_id, generation, self._facts(generation)),
                             generation)
        try:
            reply: HeartbeatReply = ray.get(self._pending[0], timeout=self._interval_s * 4)
        except ray.exceptions.GetTimeoutError:
            # The supervisor is busy, or being restarted (the call is retried on the new one). Wait for this
            # heartbeat rather than queue another behind it: a backlog would delay every worker's beats.
            return True
        except ray.exceptions.RayActorError:
            if not self._stop.is_set():
                self._on_supervisor_gone()
            return False
        generation, self._pending = self._pending[1], None
        if reply.channel != self._channel:
            self._udp_unanswered_noted = False
        self._channel = reply.channel
        self._answered = time.monotonic()
        self._judge(generation, reply)
        return True

    # -- as datagrams ---------------------------------------------------------------------------
    def _send(self) -> None:
        channel = self._channel
        assert channel is not None
        self._seq += 1
        generation = self._current_generation()
        self._sent[self._seq] = generation
        while len(self._sent) > _SEQS_KEPT:
            self._sent.popitem(last=False)
        facts = self._facts(generation)
        beat = Beat(channel.token, self._worker_id, self._seq, generation, facts["rss_bytes"], facts["cpu_percent"],
                    int(facts["report_index"]))
        host = "127.0.0.1" if channel.node_id == self._node_id else channel.host
        try:
            self._socket.sendto(beat.pack(), (host, channel.port))
        except OSError as exc:  # no route, or the port refused an earlier datagram: the fallback covers it
            logger.debug("worker %d: heartbeat datagram not sent: %s", self._worker_id, exc)

    def _receive_until(self, deadline: float) -> None:
        """Take replies until `deadline` (the next heartbeat is due then)."""
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            self._socket.settimeout(left)
            try:
                data = self._socket.recv(64)
            except (socket.timeout, BlockingIOError):
                return
            except OSError:  # e.g. ICMP port unreachable after the supervisor's endpoint closed
                continue
            answer = BeatReply.unpack(data)
            channel = self._channel
            if answer is None or channel is None or answer.token != channel.token or answer.seq not in self._sent:
                continue
            self._answered = time.monotonic()
            self._judge(self._sent[answer.seq], answer.reply)

    # -------------------------------------------------------------------------------------------
    def _judge(self, generation: int | None, reply: HeartbeatReply) -> None:
        """A heartbeat that spoke for `generation` was answered: act if that generation is over."""
        if generation is not None and (reply.fenced or reply.active_generation != generation):
            self._on_generation_ended(generation)

    def _facts(self, generation: int | None) -> dict[str, float]:
        """What a heartbeat tells besides: the process's memory and CPU, and where its loop is. Reports
        without a checkpoint reach the supervisor late (worker/report/sender.py), and a rank waits in report()'s
        barrier before sending its own: the report it entered tells the progress watchdog who is behind."""
        return {"rss_bytes": resident_bytes(), "cpu_percent": self._process.cpu_percent(),
                "report_index": float(self._report_index(generation))}
