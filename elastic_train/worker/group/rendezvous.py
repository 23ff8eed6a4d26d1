"""The store a generation's ranks meet at: rank 0 serves it, the others reach it.

Why a parked worker serves one already: a TCPStore client that finds no server listening retries
only after a backoff (~0.5 s in torch 2.13, measured: docs/process_group.md), so ranks told at
once to join a generation waited that long for a rank 0 still leaving its previous group, or still
receiving its place. Each worker parks serving a store on a port of its own, the port it tells the
supervisor; the one made rank 0 meets its peers there, and they find it listening.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from elastic_train.protocol import Assignment


class Rendezvous:
    def __init__(self, host: str, timeout_s: float):
        self._host, self._timeout = host, timedelta(seconds=timeout_s)
        self._served: dist.TCPStore | None = None  # served since this worker parked, not yet joined

    def serve(self) -> int:
        """Serve a new store (the one served before, unused, goes); returns its port, which the
        supervisor gives as `master_port` where this worker is made rank 0."""
        self._served = None
        self._served = dist.TCPStore(self._host, 0, None, is_master=True, timeout=self._timeout,
                                     wait_for_workers=False)
        return self._served.port

    def open(self, assignment: Assignment, wait: Callable[[Future[dist.TCPStore]], None]) -> dist.TCPStore:
        """`assignment`'s store: rank 0's is the one it serves (a new one if it serves none on that
        port); the others connect from a helper thread, `wait` waiting for it (an abort must be able
        to end the wait for a rank 0 that never serves it; the connect itself could not be interrupted)."""
        served, self._served = self._served, None
        if assignment.rank == 0:
            if served is not None and served.port == assignment.master_port:
                return served
            return self._store(assignment)
        opened: Future[dist.TCPStore] = Future()

        def connect() -> None:
            try:
                opened.set_result(self._store(assignment))
            except BaseException as exc:  # noqa: BLE001 - handed to the join, which raises it
                opened.set_exception(exc)

        threading.Thread(target=connect, daemon=True, name=f"elastic-train-store-{assignment.generation}").start()
        wait(opened)
        return opened.result()

    def _store(self, assignment: Assignment) -> dist.TCPStore:
        return dist.TCPStore(assignment.master_addr, assignment.master_port, assignment.world_size,
                             is_master=assignment.rank == 0, timeout=self._timeout, wait_for_workers=False)
