"""GenerationGroup on real gloo ranks: one process per rank (the default group is per process),
real TCPStores, no Ray. What abort() may touch, which generation it acts on, and how fast it acts.

Each scenario runs in every rank's process and returns what that rank saw; the test asserts on it.
Ranks coordinate through a control TCPStore of their own (`wait` on keys: no sleeps).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elastic_train.protocol import Assignment
from elastic_train.worker.group.generation import GenerationGroup
from elastic_train.worker.group.gloo import GLOO_WAITS, arrive, parse_gloo_rank
from elastic_train.worker.group.nccl_env import HOSTID_PER_PROCESS, apply_nccl_env, nccl_env

TIMEOUT_S = 30.0  # rendezvous and collective timeout of the groups: a hang fails the scenario, not CI
DESTROY_TIMEOUT_S = 1.0
RESULT_TIMEOUT_S = 60.0  # how long the test waits for every rank's result
SIDE_CONNECTIONS = 4
FORMING_S = 2.0  # the rendezvous timeout of a group whose peer dies inside it as it forms
PEER_DIED_RENDEZVOUS_S = 3.0

Scenario = Callable[[int, int, list[int], dist.TCPStore], dict[str, Any]]


# -- the harness ------------------------------------------------------------------------------------
def _assignment(generation: int, rank: int, world: int, port: int) -> Assignment:
    return Assignment(generation=generation, rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                      node_rank=0, master_addr="127.0.0.1", master_port=port, resume=None, peers={})


def _group() -> GenerationGroup:
    return GenerationGroup("gloo", TIMEOUT_S, TIMEOUT_S, destroy_timeout_s=DESTROY_TIMEOUT_S)


def _gloo_record_of_rank_0(port: int, control: dist.TCPStore, generation: int = 0) -> dist.Store:
    """The store where rank 0's gloo record appears (key "0") once its group of `generation` is forming.
    Connects once the store is up (no connection attempts while rank 0 joins, besides this one)."""
    control.wait([f"store_up/{generation}"])
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=TIMEOUT_S))
    return dist.PrefixStore("0", dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore(
        f"generation/{generation}/", client))))


def _join_by_hand(generation: int, rank: int, world: int, port: int, control: dist.TCPStore, after: str) -> None:
    """Join as GenerationGroup.join does, but enter init_process_group only once `after` is set:
    rank 0's store is up by then, and its group is forming, waiting for this rank."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    prefixed = dist.PrefixStore(f"generation/{generation}/", store)
    control.set(f"store_up/{generation}", "1")
    arrive(prefixed, rank, world, TIMEOUT_S)
    control.wait([after])
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))


def _rank_main(scenario: Scenario, rank: int, world: int, ports: list[int], conn: Any) -> None:
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(name)s: %(message)s")
    try:
        control = dist.TCPStore("127.0.0.1", ports[-1], world, is_master=rank == 0,
                                timeout=timedelta(seconds=TIMEOUT_S))
        conn.send(scenario(rank, world, ports, control))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send({"error": traceback.format_exc()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario: Scenario, world: int, generations: int = 1, reporting: list[int] | None = None) -> list[dict]:
    """Run `scenario` on `world` ranks; the results of the `reporting` ranks (all by default)."""
    ctx = mp.get_context("spawn")
    ports = [_free_port() for _ in range(generations + 1)]  # one store per generation, then the control store
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, world, ports, pipes[r][1]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    results = []
    try:
        for rank in reporting if reporting is not None else range(world):
            receiver = pipes[rank][0]
            assert receiver.poll(max(0.0, deadline - time.monotonic())), f"rank {rank} reported nothing in time"
            results.append(receiver.recv())
    finally:
        for p in procs:
            p.kill()  # a stopped (SIGSTOP) rank too
            p.join(RESULT_TIMEOUT_S)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


# -- scenarios (module level: the spawned ranks import them) ----------------------------------------
def _foreign_sockets_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """While rank 0's group forms, another thread of rank 0 opens connections (both ends in this process:
    a few, as descriptors freed meanwhile may be reused); rank 1 joins only once they are open. Then rank
    0 aborts."""
    if rank == 1:
        _join_by_hand(0, rank, world, ports[0], control, after="side_connected")
        control.wait(["done"])
        return {}
    group = _group()
    server = socket.create_server(("127.0.0.1", 0))
    side: list[tuple[socket.socket, socket.socket]] = []

    def open_side_connections() -> None:
        _gloo_record_of_rank_0(ports[0], control).wait(["0"])  # rank 0 is inside init_process_group
        for _ in range(SIDE_CONNECTIONS):
            client = socket.create_connection(server.getsockname())
            side.append((client, server.accept()[0]))
        control.set("side_connected", "1")

    opener = threading.Thread(target=open_side_connections)
    opener.start()
    group.join(_assignment(0, rank, world, ports[0]))
    opener.join(TIMEOUT_S)
    group.abort(0)
    received = []
    for client, accepted in side:
        try:
            client.sendall(b"ping")
            accepted.settimeout(TIMEOUT_S)
            received.append(accepted.recv(4))
        except OSError as exc:
            received.append(repr(exc))
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        failed = False
    except RuntimeError:
        failed = True
    result = {"received": received, "collective_failed": failed, "seconds": time.monotonic() - started}
    control.set("done", "1")
    group.leave()
    return result


def _late_abort_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """Generation 0, then 1; rank 0 gets the abort of generation 0 only once it is in generation 1."""
    group = _group()
    group.join(_assignment(0, rank, world, ports[0]))
    dist.all_reduce(torch.ones(1))
    group.leave()
    group.join(_assignment(1, rank, world, ports[1]))
    acted = group.abort(0) if rank == 0 else None
    x = torch.ones(1)
    dist.all_reduce(x)
    result = {"acted": acted, "sum": x.item(), "aborted": group.aborted, "world": dist.get_world_size()}
    group.leave()
    return result


def _stuck_collective_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """Rank 1 freezes (SIGSTOP) after the group formed; rank 0's all_reduce waits on it until aborted."""
    group = _group()
    group.join(_assignment(0, rank, world, ports[0]))
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        control.set("frozen", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        return {}
    control.wait(["frozen"])
    work = dist.all_reduce(torch.ones(1), async_op=True)
    started = time.monotonic()
    acted = group.abort(0)
    try:
        work.wait()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    result = {"acted": acted, "collective_error": error, "seconds": time.monotonic() - started}
    group.leave()
    return result


def _next_generation_alone(group: GenerationGroup, generation: int, port: int) -> float:
    """Join `generation` as the only rank; the sum of an all-reduce of one."""
    group.join(_assignment(generation, 0, 1, port))
    x = torch.ones(1)
    dist.all_reduce(x)
    group.leave()
    return x.item()


def _join_aborted_once(group: GenerationGroup, assignment: Assignment, ready: Callable[[], None],
                       next_port: int) -> dict[str, Any]:
    """Join `assignment` while another thread aborts its generation once `ready()` returns: whether the
    abort acted, what the join raised, how long after the abort the join ended; then whether the next
    generation forms (the sum of an all-reduce of one, alone)."""
    seen: dict[str, Any] = {}

    def abort() -> None:
        ready()
        seen["aborted_at"] = time.monotonic()
        seen["acted"] = group.abort(assignment.generation)

    aborter = threading.Thread(target=abort)
    aborter.start()
    try:
        group.join(assignment)
        seen["join_error"] = None
    except Exception as exc:  # noqa: BLE001 - what the test expects
        seen["join_error"] = str(exc)
    seen["seconds"] = time.monotonic() - seen.get("aborted_at", float("inf"))
    aborter.join(TIMEOUT_S)
    group.leave()
    seen["next_sum"] = _next_generation_alone(group, assignment.generation + 1, next_port)
    return seen


def _abort_while_forming_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """The abort of generation 0 reaches rank 0 while its group is forming, waiting for rank 1, which
    arrived at the group (`arrive`) but never enters it (it died)."""
    if rank == 1:
        store = dist.TCPStore("127.0.0.1", ports[0], world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        control.set("store_up/0", "1")
        arrive(dist.PrefixStore("generation/0/", store), rank, world, TIMEOUT_S)
        control.wait(["done"])
        return {}
    seen = _join_aborted_once(_group(), _assignment(0, rank, world, ports[0]),
                              lambda: _gloo_record_of_rank_0(ports[0], control).wait(["0"]), ports[1])
    control.set("done", "1")
    return seen


def _abort_at_the_door_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """The abort of generation 0 reaches rank 0 while it waits at its group's door for rank 1, which
    reached the store but never arrives (it died)."""
    if rank == 1:
        dist.TCPStore("127.0.0.1", ports[0], world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        control.set("store_up/0", "1")
        control.wait(["done"])
        return {}

    def rank_0_arrived() -> None:
        control.wait(["store_up/0"])
        client = dist.TCPStore("127.0.0.1", ports[0], is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=TIMEOUT_S))
        dist.PrefixStore("generation/0/", client).wait(["arrived/0"])

    seen = _join_aborted_once(_group(), _assignment(0, rank, world, ports[0]), rank_0_arrived, ports[1])
    control.set("done", "1")
    return seen


def _peer_died_in_the_group_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """Rank 0 serves its store from its park (the port it gave); rank 1 arrives at the group (with rank
    0's arrival, made for it: rank 0 is slower to its join), enters it (its gloo record is in the store)
    and dies there, SIGKILLed, as a peer lost a moment after its generation opened. Then rank 0 joins,
    with a collective timeout of minutes: how long its join takes, and whether the next generation
    forms."""
    if rank == 1:
        control.wait(["served"])
        port = int(control.get("store_port"))
        store = dist.PrefixStore("generation/0/", dist.TCPStore("127.0.0.1", port, world, is_master=False,
                                                                timeout=timedelta(seconds=TIMEOUT_S)))
        store.set("arrived/0", "1")
        arrive(store, 1, world, TIMEOUT_S)
        # As init_process_group makes its gloo backend (store prefixes and all), on 127.0.0.2: gloo
        # connects a pair from the side whose address is the greater, so rank 0 (127.0.0.1) is the one
        # that waits for this rank to connect.
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.2")]
        options._timeout = timedelta(seconds=TIMEOUT_S)
        backend_store = dist.PrefixStore("cpu/", dist.PrefixStore("0/", store))
        threading.Thread(target=dist.ProcessGroupGloo, args=(backend_store, 1, world, options), daemon=True).start()
        _gloo_records(port).wait(["1"])  # its own record written: it is in the group
        control.set("pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    group = GenerationGroup("gloo", FORMING_S, 10 * TIMEOUT_S, destroy_timeout_s=DESTROY_TIMEOUT_S)
    port = group.rendezvous.serve()
    control.set("store_port", str(port))
    control.set("served", "1")
    _wait_dead(int(control.get("pid")))
    started = time.monotonic()
    try:
        group.join(_assignment(0, 0, world, port))  # where gloo connects lazily, its first collective fails
        dist.all_reduce(torch.ones(1))
        failure = None
    except Exception as exc:  # noqa: BLE001 - what the test expects
        failure = str(exc)
    seconds = time.monotonic() - started
    group.leave()
    return {"failure": failure, "seconds": seconds, "next_sum": _next_generation_alone(group, 1, ports[1])}


def _wait_dead(pid: int) -> None:
    """Until process `pid` (not a child of this one: its parent reaps it) has died."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} still runs")


def _gloo_records(port: int) -> dist.Store:
    """Where the gloo records of generation 0's ranks appear (key: the rank), in the store at `port`."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=TIMEOUT_S))
    return dist.PrefixStore("0", dist.PrefixStore("cpu/", dist.PrefixStore("0/", dist.PrefixStore("generation/0/",
                                                                                                    client))))


def _rank_0_never_serves_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """This process is rank 1 of 2; rank 0's store port accepts the connection (the kernel's backlog)
    but never answers (rank 0 froze or died as it started). The next generation forms though the
    connecting thread is still stuck."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT_S)
    accepted: list[socket.socket] = []  # kept open until the scenario ends
    return _join_aborted_once(_group(), _assignment(0, 1, 2, listener.getsockname()[1]),
                              lambda: accepted.append(listener.accept()[0]), ports[1])


def _stuck_teardown_scenario(rank: int, world: int, ports: list[int], control: dist.TCPStore) -> dict:
    """The backend's shutdown hangs: leave() must not wait for it, the next join at most the deadline."""
    release = threading.Event()
    shutdown = dist.ProcessGroup.shutdown

    def hanging_shutdown(self: dist.ProcessGroup) -> None:
        release.wait(TIMEOUT_S)
        shutdown(self)

    dist.ProcessGroup.shutdown = hanging_shutdown
    group = _group()
    group.join(_assignment(0, rank, world, ports[0]))
    started = time.monotonic()
    group.leave()
    leave_s = time.monotonic() - started
    started = time.monotonic()
    group.join(_assignment(1, rank, world, ports[1]))
    join_s = time.monotonic() - started
    x = torch.ones(1)
    dist.all_reduce(x)
    release.set()
    group.leave()
    return {"leave_s": leave_s, "join_s": join_s, "sum": x.item()}


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_abort_spares_sockets_other_threads_open_while_the_group_forms():
    rank0, _ = _run(_foreign_sockets_scenario, world=2)
    assert rank0["received"] == [b"ping"] * SIDE_CONNECTIONS, "abort() shut down connections that are not the group's"
    assert rank0["collective_failed"] and rank0["seconds"] < 1.0, rank0


@pytest.mark.timeout(90)
def test_late_abort_of_a_generation_leaves_the_next_one_alone():
    rank0, rank1 = _run(_late_abort_scenario, world=2, generations=2)
    assert rank0["acted"] is False
    assert rank0["sum"] == rank1["sum"] == 2.0 and rank0["world"] == 2
    assert not rank0["aborted"] and not rank1["aborted"]


@pytest.mark.timeout(90)
def test_abort_interrupts_a_collective_stuck_on_a_frozen_peer_within_a_second():
    (rank0,) = _run(_stuck_collective_scenario, world=2, reporting=[0])
    assert rank0["acted"] is True
    assert rank0["collective_error"] is not None, "the collective completed without its frozen peer"
    assert rank0["seconds"] < 1.0, f"abort took {rank0['seconds']:.2f}s (the collective timeout is {TIMEOUT_S}s)"


def _assert_join_ended_at_once(result: dict[str, Any]) -> None:
    assert result["acted"] is True and result["join_error"] is not None, result
    assert result["seconds"] < 1.0, f"the join ended {result['seconds']:.2f}s after the abort (timeout {TIMEOUT_S}s)"
    assert result["next_sum"] == 1.0, "the next generation did not form"


@pytest.mark.timeout(90)
def test_abort_while_the_group_forms_ends_the_join_at_once():
    rank0, _ = _run(_abort_while_forming_scenario, world=2, generations=2)
    _assert_join_ended_at_once(rank0)


@pytest.mark.timeout(90)
def test_abort_while_waiting_at_the_groups_door_for_a_peer_ends_the_join_at_once():
    rank0, _ = _run(_abort_at_the_door_scenario, world=2, generations=2)
    _assert_join_ended_at_once(rank0)


@pytest.mark.timeout(90)
def test_a_rank_whose_peer_died_inside_the_forming_group_leaves_it_within_its_rendezvous_timeout():
    """gloo connects the pair from one side, out of reach of an abort: connecting to the dead peer's
    listener it retried until its timeout, and waiting for the peer to connect it gives up after
    GLOO_WAITS times its timeout, which was the collective one (minutes): the supervisor dropped the
    survivor as hung after drain_timeout_s, and its state with it. Connection retries are now off in
    the workers (that side fails at once); every rank arrives at the group before gloo connects, and
    gloo's timeout is the rendezvous timeout over GLOO_WAITS: the waiting side leaves within the
    rendezvous timeout, which drain_timeout_s exceeds."""
    (rank0,) = _run(_peer_died_in_the_group_scenario, world=2, generations=2, reporting=[0])
    assert rank0["failure"] is not None and rank0["seconds"] < FORMING_S + 1.0, rank0
    assert rank0["seconds"] > FORMING_S / GLOO_WAITS * 0.9, rank0  # it waited: this rank was the waiting side
    assert rank0["next_sum"] == 1.0, "the next generation did not form"


@pytest.mark.timeout(90)
def test_abort_ends_a_join_waiting_for_a_rank_0_that_never_serves_its_store():
    (result,) = _run(_rank_0_never_serves_scenario, world=1, generations=2)
    _assert_join_ended_at_once(result)


@pytest.mark.timeout(90)
def test_teardown_runs_off_the_training_thread_and_the_next_join_waits_at_most_the_deadline():
    (result,) = _run(_stuck_teardown_scenario, world=1, generations=2)
    assert result["leave_s"] < 0.5, result
    assert DESTROY_TIMEOUT_S * 0.9 <= result["join_s"] < DESTROY_TIMEOUT_S + 5.0, result
    assert result["sum"] == 1.0


@pytest.mark.timeout(10)
def test_parse_gloo_rank_record_ipv4_and_ipv6():
    def record(sockaddr: bytes) -> bytes:
        hostname = b"node-7"
        address = sockaddr.ljust(128, b"\0") + struct.pack("=q", 5)  # sockaddr_storage, then the sequence number
        return (struct.pack("=Q", len(hostname)) + hostname + struct.pack("=Q", len(address)) + address
                + struct.pack("=qq", 0, 1))

    ipv4 = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 41749) + socket.inet_pton(socket.AF_INET, "10.1.2.3")
    ipv6 = (struct.pack("=H", socket.AF_INET6) + struct.pack("!H", 5000) + b"\0" * 4
            + socket.inet_pton(socket.AF_INET6, "fd00::7"))
    assert parse_gloo_rank(record(ipv4)) == ("10.1.2.3", 41749)
    assert parse_gloo_rank(record(ipv6)) == ("fd00::7", 5000)


@pytest.mark.timeout(10)
def test_nccl_env_keeps_the_watchdog_from_ending_the_process(monkeypatch):
    env = nccl_env(nonblocking_timeout_s=20.0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort comms, keep the process
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert int(env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) * 4 <= 1000  # the watchdog's post-error sleep
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "20"
    assert all(isinstance(v, str) for v in env.values())
    # Applied in the worker before its first NCCL group: what the user set wins.
    for name in env:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    monkeypatch.setenv(HOSTID_PER_PROCESS, "1")
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    apply_nccl_env(20.0)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["NCCL_HOSTID"].endswith(f"-{os.getpid()}")


@pytest.mark.timeout(60)
def test_a_peer_meets_rank_0_at_the_store_it_served_as_it_parked_before_rank_0_joins():
    """A worker parks serving a store (`Rendezvous.serve`, the port it gives the supervisor): a peer
    told to join connects at once, while the worker made rank 0 has not reached its join yet (a client
    that finds no server listening would retry only after torch's backoff), and rank 0 meets it there."""
    from concurrent.futures import Future

    from elastic_train.worker.group.rendezvous import Rendezvous

    def wait(opened: Future) -> None:
        opened.result(TIMEOUT_S)

    leader, peer = Rendezvous("127.0.0.1", TIMEOUT_S), Rendezvous("127.0.0.1", TIMEOUT_S)
    leader.serve()  # an earlier park's store: replaced by the next one
    port = leader.serve()
    reached = peer.open(_assignment(3, 1, 2, port), wait)  # returns once connected: nobody opened rank 0's yet
    reached.set("from the peer", b"1")
    served = leader.open(_assignment(3, 0, 2, port), wait)
    assert served.port == port and served.get("from the peer") == b"1"
    other = leader.open(_assignment(4, 0, 2, _free_port()), wait)  # no store served on that port: a new one
    assert other.port != port
