"""Heartbeat intake: a live worker's record is refreshed, a lost one is told it is fenced, and the
reply says whether the worker's generation still goes on. Heartbeats come as UDP datagrams, and as
Ray calls (a worker's first, and its fallback).

Why UDP: a heartbeat that arrives as a Ray actor call costs the supervisor about a millisecond of CPU
(`benchmarks/scale.py` measured it): one core served ~800 a second, some 400 workers at the default
interval. A datagram costs it tens of microseconds, so 10,000 workers fit in a fraction of a core.
Ray calls remain the bootstrap and the fallback (`worker/heartbeat.py`): the reply to one tells a
worker this endpoint's address, and a worker whose datagrams go unanswered (UDP blocked between its
machine and this one, or a supervisor Ray restarted on another port) heartbeats through Ray again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from typing import Callable

import ray

from elastic_train.config import ElasticConfig
from elastic_train.events import FencedHeartbeat
from elastic_train.protocol import TOKEN_BYTES, Beat, BeatReply, HeartbeatChannel, HeartbeatReply
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunView
from elastic_train.supervisor.watch.telemetry import Telemetry

logger = logging.getLogger(__name__)

RECEIVE_BUFFER_BYTES = 8 * 2**20


class HeartbeatEndpoint(asyncio.DatagramProtocol):
    """Answers each `Beat` carrying this supervisor's token with `answer(beat)`; `answer` returning None
    (not ready to judge, e.g. before adoption) sends nothing. Runs on the supervisor's event loop, so
    `answer` sees the records as the actor's methods do."""

    def __init__(self, token: bytes, answer: Callable[[Beat], HeartbeatReply | None]):
        self._token = token
        self._answer = answer
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        beat = Beat.unpack(data)
        if beat is None or beat.token != self._token or self._transport is None:
            return
        reply = self._answer(beat)
        if reply is None:
            return
        self._transport.sendto(BeatReply(self._token, beat.worker_id, beat.seq, reply).pack(), addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("heartbeat endpoint: %s", exc)  # e.g. ICMP port unreachable from a worker that ended

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


async def open_endpoint(host: str, node_id: str,
                        answer: Callable[[Beat], HeartbeatReply | None]) -> tuple[HeartbeatEndpoint, HeartbeatChannel]:
    """Listen on every interface, on a free port; returns the endpoint and the channel workers are told
    (`host`: this node's address as Ray knows it)."""
    token = secrets.token_bytes(TOKEN_BYTES)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    widen_receive_buffer(sock)
    transport, endpoint = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: HeartbeatEndpoint(token, answer), sock=sock)
    return endpoint, HeartbeatChannel(host, sock.getsockname()[1], node_id, token)


def widen_receive_buffer(sock: socket.socket) -> None:
    """Let the socket queue RECEIVE_BUFFER_BYTES of datagrams: at 10,000 workers 20,000 a second arrive,
    and the kernel's default (about 200 KB, a few hundred datagrams) drops them whenever the event loop
    is busy for ~15 ms. Past `net.core.rmem_max` only a privileged process may go (SO_RCVBUFFORCE);
    otherwise the kernel caps it there."""
    for option in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
        if option is None:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, RECEIVE_BUFFER_BYTES)
            return
        except OSError:
            continue


class Heartbeats:
    def __init__(self, run: RunView, elastic: ElasticConfig, roster: Roster, telemetry: Telemetry,
                 serving: asyncio.Event):
        """No heartbeat is judged before `serving` is set (a restarted supervisor adopts first)."""
        self._run = run
        self._elastic = elastic
        self._roster = roster
        self._telemetry = telemetry
        self._serving = serving
        self._endpoint: HeartbeatEndpoint | None = None
        self.channel: HeartbeatChannel | None = None  # where workers send datagrams; None: through Ray calls
        self.counts = {"udp": 0, "ray": 0}  # heartbeats received, by the path they took

    async def open(self) -> None:
        """Listen for datagrams (unless `heartbeat_udp` is off): the channel goes with every reply to a
        heartbeat call."""
        if self._elastic.heartbeat_udp:
            self._endpoint, self.channel = await open_endpoint(
                ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), self._datagram)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()

    def by_call(self, w: WorkerRecord | None, worker_id: int, generation: int | None,
                facts: dict[str, float]) -> HeartbeatReply:
        """A heartbeat through Ray; the reply names the channel for the next ones."""
        self.counts["ray"] += 1
        reply = self._answer(w, worker_id, generation, facts)
        reply.channel = self.channel
        return reply

    def _datagram(self, beat: Beat) -> HeartbeatReply | None:
        if not self._serving.is_set():
            return None
        self.counts["udp"] += 1
        facts = {"rss_bytes": beat.rss_bytes, "cpu_percent": beat.cpu_percent, "report_index": beat.report_index}
        return self._answer(self._roster.records.get(beat.worker_id), beat.worker_id, beat.generation, facts)

    def _answer(self, w: WorkerRecord | None, worker_id: int, generation: int | None,
                facts: dict[str, float]) -> HeartbeatReply:
        if w is None:
            return HeartbeatReply(active_generation=None, fenced=True)
        fenced = w.status is WorkerStatus.LOST
        if fenced:
            self._telemetry.record(FencedHeartbeat(worker_id, w.pid, generation))
        else:
            self._roster.beat(w, facts, generation == self._run.generation and self._run.is_member(w))
        return HeartbeatReply(active_generation=self._run.generation if self._run.state.training else None,
                              fenced=fenced)
