"""Heartbeats as UDP datagrams (supervisor/heartbeats.py, worker/heartbeat.py): the wire format, the
supervisor's endpoint on a real socket, and a worker's sender falling back to Ray calls while its
datagrams go unanswered and back to datagrams once they are answered."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import time

import psutil
import pytest
import ray

from elastic_train.protocol import TOKEN_BYTES, Beat, BeatReply, HeartbeatChannel, HeartbeatReply
from elastic_train.supervisor.heartbeats import open_endpoint
from elastic_train.worker.heartbeat import HeartbeatSender
from elastic_train.worker.resident import resident_bytes
from tests.helpers import wait_for

TOKEN = bytes(range(TOKEN_BYTES))


@pytest.mark.timeout(10)
def test_beats_and_replies_survive_the_wire_and_strays_are_dropped():
    for generation, index in ((None, -1), (0, 0), (41, 123456)):
        beat = Beat(TOKEN, 12345, 7, generation, 3.5e9, 97.5, index)
        assert Beat.unpack(beat.pack()) == beat
    for active, fenced in ((None, False), (3, True)):
        answer = BeatReply(TOKEN, 9, 8, HeartbeatReply(active, fenced))
        assert BeatReply.unpack(answer.pack()) == answer
    packed = Beat(TOKEN, 1, 1, 0, 1.0, 1.0).pack()
    for stray in (b"", packed[:-1], packed + b"x", b"XXXX" + packed[4:], BeatReply(TOKEN, 1, 1, HeartbeatReply(0)).pack()):
        assert Beat.unpack(stray) is None, stray
    assert BeatReply.unpack(packed) is None


@pytest.mark.timeout(10)
def test_the_endpoint_answers_beats_with_its_token_only():
    async def scenario() -> list:
        seen: list[Beat] = []

        def answer(beat: Beat) -> HeartbeatReply | None:
            seen.append(beat)
            return None if beat.worker_id == 3 else HeartbeatReply(5, fenced=beat.worker_id == 2)

        endpoint, channel = await open_endpoint("127.0.0.1", "node", answer)
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            for worker_id, token in ((1, channel.token), (2, channel.token), (3, channel.token), (4, TOKEN)):
                client.sendto(Beat(token, worker_id, 10 + worker_id, 5, 1.0, 2.0).pack(), ("127.0.0.1", channel.port))
            replies = []
            deadline = loop.time() + 2
            while len(replies) < 2 and loop.time() < deadline:
                try:
                    replies.append(BeatReply.unpack(await asyncio.wait_for(loop.sock_recv(client, 64), 0.5)))
                except asyncio.TimeoutError:
                    pass
            try:  # nothing more comes: worker 3 was not answered, worker 4's token was not this endpoint's
                replies.append(BeatReply.unpack(await asyncio.wait_for(loop.sock_recv(client, 64), 0.3)))
            except asyncio.TimeoutError:
                pass
        finally:
            client.close()
            endpoint.close()
        assert [b.worker_id for b in seen] == [1, 2, 3]
        return replies

    replies = asyncio.run(scenario())
    assert sorted((r.worker_id, r.seq, r.reply.active_generation, r.reply.fenced) for r in replies) == [
        (1, 11, 5, False), (2, 12, 5, True)]
    assert all(r.token != TOKEN for r in replies)


@ray.remote(num_cpus=0)
class _Supervisor:
    """Plays the supervisor's Ray side for one sender: answers its heartbeat calls, naming a channel."""

    def __init__(self, channel: HeartbeatChannel):
        self._channel, self._calls = channel, []

    def heartbeat(self, worker_id: int, generation: int | None, facts: dict[str, float]) -> HeartbeatReply:
        self._calls.append(time.monotonic())
        return HeartbeatReply(active_generation=generation, channel=self._channel)

    def calls(self) -> list[float]:
        return self._calls


@pytest.mark.timeout(60)
def test_a_sender_heartbeats_through_ray_while_its_datagrams_go_unanswered(local_ray):
    """With UDP blocked, Ray calls keep coming, no further apart than the reply timeout + an interval +
    the call itself (the config keeps heartbeat_timeout_s above reply timeout + 2 intervals); answered
    datagrams stop them; a fenced reply ends the generation."""
    interval, reply_timeout = 0.2, 0.6
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    channel = HeartbeatChannel("192.0.2.1", listener.getsockname()[1], "this-node", TOKEN)  # on this node: loopback
    supervisor = _Supervisor.remote(channel)
    ended: list[int] = []
    sender = HeartbeatSender(supervisor, 4, "this-node", interval, reply_timeout, lambda: 7,
                             lambda generation: 30 + generation, ended.append, lambda: ended.append(-1))
    sender.start()
    try:
        listener.settimeout(30)  # the first datagram follows the bootstrap call (the stand-in actor starts first)
        datagrams: list[Beat] = [Beat.unpack(listener.recv(64))]
        listener.settimeout(0.1)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # unanswered: the datagrams arrive, Ray calls keep the worker alive
            try:
                datagrams.append(Beat.unpack(listener.recv(64)))
            except socket.timeout:
                pass
        calls = ray.get(supervisor.calls.remote())
        assert len(calls) >= 4 and len(datagrams) >= 4, (calls, datagrams)  # ~3 s / (0.6 + 0.2 s), plus the first
        # A call comes at most an interval after the reply timeout ran out, plus the call's own time (0.5 s
        # allowed on a loaded machine): well within any heartbeat_timeout_s the config accepts.
        assert max(b - a for a, b in zip(calls, calls[1:])) < reply_timeout + 2 * interval + 0.5, calls
        # Each names the worker, its generation and the report its loop entered there (for the watchdog).
        assert {(b.worker_id, b.generation, b.token, b.report_index) for b in datagrams} == {(4, 7, TOKEN, 37)}

        def answer_for(seconds: float, fenced: bool = False) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                try:
                    data, addr = listener.recvfrom(64)
                except socket.timeout:
                    continue
                beat = Beat.unpack(data)
                listener.sendto(BeatReply(TOKEN, beat.worker_id, beat.seq, HeartbeatReply(7, fenced)).pack(), addr)

        answer_for(0.5)  # the first answered datagram switches it back
        settled = len(ray.get(supervisor.calls.remote()))
        answer_for(2.0)
        assert len(ray.get(supervisor.calls.remote())) == settled, "Ray calls while datagrams were answered"
        assert ended == []
        answer_for(0.5, fenced=True)
        wait_for(lambda: 7 in ended, 5, "the fenced reply to end generation 7")
    finally:
        sender.stop()
        listener.close()
        ray.kill(supervisor)


def _allocate_and_measure() -> tuple[float, float, float]:
    """In a forked child: its RSS as read here before and after touching 256 MiB, and psutil's after."""
    before = resident_bytes()
    block = bytearray(256 * 2**20)  # zero pages: resident only once written
    block[::4096] = b"x" * len(block[::4096])
    return before, resident_bytes(), float(psutil.Process().memory_info().rss)


@pytest.mark.timeout(30)
def test_resident_memory_follows_allocations_and_a_forked_child_reads_its_own():
    assert abs(resident_bytes() - psutil.Process().memory_info().rss) < 16 * 2**20
    parent = resident_bytes()  # the file is open now: a forked child inherits it, and must not read through it
    with multiprocessing.get_context("fork").Pool(1) as pool:
        before, after, by_psutil = pool.apply(_allocate_and_measure)
    assert after - before > 200 * 2**20 and abs(after - by_psutil) < 16 * 2**20
    assert resident_bytes() < parent + 64 * 2**20  # the parent's own, without the child's block
