"""gloo's side of a generation's group: the door its ranks wait at before gloo connects them, and
the group's TCP connections in this process, found and shut down (what an abort of a gloo group is:
gloo has no abort of its own). docs/process_group.md: why, and what was measured.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from datetime import timedelta
from typing import Any

import psutil
import torch.distributed as dist

logger = logging.getLogger(__name__)

Address = tuple[str, int]
Connection = tuple[int, Address, Address]  # descriptor, local end, remote end


# The side of a gloo pair that waits for its peer to connect gives up after this many times the group's
# timeout (measured with torch 2.13: tests/test_process_group.py, a peer dead inside the forming group).
GLOO_WAITS = 5


def arrive(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait at the group's door until every rank of it arrived (or `timeout_s`): a rank's peers then wait
    for it here, on the store, where an abort ends the wait (`GenerationGroup.abort`), and not inside
    gloo's connections, where none does."""
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def gloo_listeners(group: dist.ProcessGroup, rank: int, world_size: int) -> list[Address] | None:
    """Each rank's gloo listening address, from gloo's own rendezvous records in the group's store
    (key `<group>/cpu/<device index>/<rank>`: hostname, device address, pair ids; see `Rank::bytes` in
    gloo/transport/tcp/context.cc). None if they cannot be read or this rank's is not its listener."""
    try:
        store = dist.PrefixStore("0", dist.PrefixStore("cpu/", group.get_group_store()))
        listeners = [parse_gloo_rank(store.get(str(r))) for r in range(world_size)]
    except Exception as exc:  # noqa: BLE001 - another gloo layout: fall back, loudly
        logger.warning("gloo's rendezvous records could not be read (%s); abort() falls back to the connections "
                       "opened while the group formed, which may include other threads' sockets", exc)
        return None
    own = {_address(c.laddr) for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    if not any(matches(a, listeners[rank]) for a in own):
        logger.warning("gloo's record of rank %d (%s) is not a listening socket of this process; abort() falls "
                       "back to the connections opened while the group formed", rank, listeners[rank])
        return None
    return listeners


def parse_gloo_rank(data: bytes) -> Address:
    """The listening address in a gloo TCP `Rank` record: size_t + hostname, size_t + address
    (a sockaddr_storage, then a sequence number), then the pair ids."""
    (hostname_size,) = struct.unpack_from("=Q", data, 0)
    offset = 8 + hostname_size
    (address_size,) = struct.unpack_from("=Q", data, offset)
    sockaddr = data[offset + 8 : offset + 8 + address_size]
    (family,) = struct.unpack_from("=H", sockaddr, 0)
    (port,) = struct.unpack_from("!H", sockaddr, 2)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, sockaddr[4:8]), port
    if family == socket.AF_INET6:
        return _address((socket.inet_ntop(socket.AF_INET6, sockaddr[8:24]), port))
    raise ValueError(f"address family {family} in a gloo rank record")


def gloo_connections(listeners: list[Address], rank: int) -> list[Connection]:
    """This process's connections of the group: accepted by this rank's listener, or made to a peer's."""
    own, peers = listeners[rank], [a for r, a in enumerate(listeners) if r != rank]
    return [c for c in connections() if matches(c[1], own) or any(matches(c[2], p) for p in peers)]


def connections() -> list[Connection]:
    return [(c.fd, _address(c.laddr), _address(c.raddr))
            for c in psutil.Process().net_connections("tcp") if c.fd >= 0 and c.raddr]


def established() -> set[tuple[Address, Address]]:
    return {(local, remote) for _, local, remote in connections()}


def shut_down(fd: int, local: Address, remote: Address) -> bool:
    """Shut down the connection `local`-`remote` at `fd`, if `fd` still is that connection."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    try:
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return False  # the descriptor was reused for something else than a socket
    with sock:
        try:
            if _address(sock.getsockname()) != local or _address(sock.getpeername()) != remote:
                return False  # the descriptor was reused for another socket
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False  # not connected (any more)


def _address(address: Any) -> Address:
    """(ip, port) of a psutil or socket address; IPv4-mapped IPv6 addresses as plain IPv4."""
    ip, port = address[0], address[1]
    return (ip[7:] if ip.startswith("::ffff:") and "." in ip else ip), port


def matches(address: Address, listener: Address) -> bool:
    """Same port, and the same IP unless one of them is a wildcard (bound to all interfaces)."""
    wildcards = ("0.0.0.0", "::")
    return address[1] == listener[1] and (
        address[0] == listener[0] or address[0] in wildcards or listener[0] in wildcards
    )
