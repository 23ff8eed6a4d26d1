"""The supervisor's UDP heartbeat endpoint.

Why: a heartbeat that arrives as a Ray actor call costs the supervisor about a millisecond of CPU
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

from elastic_train.protocol import TOKEN_BYTES, Beat, BeatReply, HeartbeatChannel, HeartbeatReply

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
