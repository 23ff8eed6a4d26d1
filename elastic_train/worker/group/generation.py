"""The torch.distributed process group of one generation: join, abort, leave.

A survivor keeps its process across generations; only the group is torn down and rebuilt. Each
generation's group is this process's *default* group, so `dist.all_reduce(x)`, `dist.get_rank()` and
DDP without a named group work unchanged and see the generation's world (where loops go on in place,
through a `WorldGroup` that follows the loop into later generations: worker/group/world.py). `abort(g)` acts only on
generation `g`'s group, at once, from any thread (gloo: its TCP connections are shut down; NCCL:
non-blocking communicators aborted), also while that group is still forming; `leave()` tears the group
down off the training thread, with a deadline. docs/process_group.md: why each step, what was measured.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from elastic_train.protocol import Assignment
from elastic_train.worker.group.devices import get_device
from elastic_train.worker.group.gloo import (GLOO_WAITS, Address, Connection, arrive, connections, established,
                                             gloo_connections, gloo_listeners, matches, shut_down)
from elastic_train.worker.group.nccl_env import apply_nccl_env
from elastic_train.worker.group.rendezvous import Rendezvous
from elastic_train.worker.group.world import WorldGroup, forget, install

logger = logging.getLogger(__name__)


class GenerationGroup:
    """Owns the default process group of the generation this worker belongs to."""

    def __init__(
        self,
        backend: str,
        rendezvous_timeout_s: float,
        collective_timeout_s: float,
        destroy_timeout_s: float,
        in_place: bool = False,
        host: str = "127.0.0.1",
    ):
        self.backend = backend
        if backend == "gloo":
            os.environ.setdefault("GLOO_DISABLE_CONNECTION_RETRIES", "1")  # read once, at gloo's first connect: see join
        self.rendezvous = Rendezvous(host, rendezvous_timeout_s)  # the store this worker serves as it parks
        self._in_place = in_place and backend == "gloo"  # the default group is the process's WorldGroup
        self._rendezvous_timeout_s = rendezvous_timeout_s
        self._collective_timeout_s = collective_timeout_s
        self._destroy_timeout_s = destroy_timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an abort, or the store's connect done
        self._generation: int | None = None  # the generation joined (or joining)
        self._group: dist.ProcessGroup | None = None  # its default group, once formed
        self._store: dist.TCPStore | None = None
        self._aborted = threading.Event()
        self._listeners: list[Address] | None = None  # gloo: each rank's listening address
        self._fallback: list[Connection] = []  # gloo, when the listeners could not be read
        self._rank = -1
        self._aborting: threading.Thread | None = None  # NCCL: the abort under way
        self._teardown: _Teardown | None = None  # the previous generation's group, going away

    # -- join -----------------------------------------------------------------------------------
    def join(self, assignment: Assignment) -> None:
        """Rendezvous with the generation's other ranks and make their group this process's default one."""
        self._await_teardown()
        with self._lock:
            self._generation, self._group, self._rank = assignment.generation, None, assignment.rank
            self._aborted.clear()
            self._listeners, self._fallback = None, []
        store = self._open_store(assignment)
        with self._lock:
            if self._aborted.is_set():
                self._raise_aborted()
            self._store = store  # from here an abort shuts down its connections
        gloo = self.backend == "gloo"
        before = established() if gloo else set()
        prefixed = dist.PrefixStore(f"generation/{assignment.generation}/", self._store)
        if gloo:
            arrive(prefixed, assignment.rank, assignment.world_size, self._rendezvous_timeout_s)
        # gloo: a peer that dies inside the forming group leaves the others connecting to its listener, or
        # waiting for it to connect, which no abort interrupts. Connecting fails at once (GLOO_DISABLE_
        # CONNECTION_RETRIES, set as the worker starts); waiting ends after GLOO_WAITS x the group's timeout:
        # every rank has arrived (`arrive`, which an abort does end), so gloo's share of the rendezvous
        # timeout is that over GLOO_WAITS. Each collective is then bounded by its own timeout.
        dist.init_process_group(
            self.backend,
            store=prefixed,
            rank=assignment.rank,
            world_size=assignment.world_size,
            timeout=timedelta(seconds=self._rendezvous_timeout_s / GLOO_WAITS if gloo else self._collective_timeout_s),
            **(self._nccl_options() if self.backend == "nccl" else {}),
        )
        _export_env(assignment)
        group = dist.group.WORLD
        if gloo:
            group.set_timeout(timedelta(seconds=self._collective_timeout_s))
        listeners, fallback = None, []
        if gloo:
            listeners = gloo_listeners(group, assignment.rank, assignment.world_size)
            if listeners is None:
                fallback = [c for c in connections() if (c[1], c[2]) not in before]
        if self._in_place:
            install(group)
        with self._lock:
            self._group, self._listeners, self._fallback = group, listeners, fallback
            if self._aborted.is_set():  # an abort of this generation came while its group was forming
                self._abort_locked()

    def _open_store(self, assignment: Assignment) -> dist.TCPStore:
        def wait(opened: Future[dist.TCPStore]) -> None:
            opened.add_done_callback(lambda _: self._notify())
            with self._changed:
                self._changed.wait_for(lambda: opened.done() or self._aborted.is_set())
                if not opened.done():
                    self._raise_aborted()

        return self.rendezvous.open(assignment, wait)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _raise_aborted(self) -> NoReturn:
        raise RuntimeError(f"generation {self._generation} ended while this worker was joining its group")

    def _nccl_options(self) -> dict[str, Any]:
        """A non-blocking communicator (abortable while an op is in flight), made at once on this GPU."""
        apply_nccl_env(self._rendezvous_timeout_s)
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = False
        options.is_high_priority_stream = False
        return {"pg_options": options, "device_id": torch.device("cuda", torch.cuda.current_device())}

    # -- abort ----------------------------------------------------------------------------------
    def abort(self, generation: int) -> bool:
        """Make every operation of `generation`'s group, in flight or future, fail at once; False if
        this worker's group is of another generation (a late abort). Thread-safe, does not block."""
        with self._lock:
            if generation != self._generation:
                logger.info("abort of generation %d ignored: this worker's group is of generation %s",
                            generation, self._generation)
                return False
            if not self._aborted.is_set():
                self._aborted.set()
                self._changed.notify_all()
                if self._group is not None:
                    self._abort_locked()
                elif self._store is not None:  # forming: its store waits fail (join aborts the group if formed)
                    self._shut_down_store()
            return True

    def _shut_down_store(self) -> None:
        master = (self._store.host, self._store.port)
        closed = sum(shut_down(*c) for c in connections() if matches(c[1], master) or matches(c[2], master))
        logger.info("generation %s ended while its group formed: shut down %d store connections", self._generation,
                    closed)

    def _abort_locked(self) -> None:
        if self.backend == "gloo":
            if self._listeners is not None:
                ours = gloo_connections(self._listeners, self._rank)
            else:
                ours = self._fallback
            closed = sum(shut_down(*c) for c in ours)
            logger.info("aborted the group of generation %s: shut down %d gloo connections", self._generation, closed)
        else:
            groups = _registered_groups()
            logger.info("aborting the group of generation %s (%d process groups)", self._generation, len(groups))
            self._aborting = threading.Thread(
                target=_abort_groups, args=(groups, self._generation), daemon=True,
                name=f"elastic-train-abort-{self._generation}",
            )
            self._aborting.start()

    @property
    def aborted(self) -> bool:
        """Was the current generation's group aborted?"""
        return self._aborted.is_set()

    # -- leave ----------------------------------------------------------------------------------
    def leave(self) -> None:
        """Let the generation's group go; the process stays, ready for the next generation. Does not
        block: the backends are torn down on a thread of their own, which the next join awaits."""
        with self._lock:
            generation, aborted, aborting = self._generation, self._aborted.is_set(), self._aborting
            self._generation, self._group, self._store, self._aborting = None, None, None, None
            self._listeners, self._fallback = None, []
            forget()
            try:
                groups = _forget_groups()
            except AttributeError as exc:  # another c10d layout: destroy here, blocking, as torch does
                logger.warning("c10d's registry has another layout (%s): destroying the group on this thread", exc)
                groups = []
                if dist.is_initialized():
                    dist.destroy_process_group()
        if groups or aborting is not None:
            self._teardown = _Teardown(generation, groups, self.backend, aborted, aborting)
            self._teardown.start()

    def _await_teardown(self) -> None:
        teardown, self._teardown = self._teardown, None
        if teardown is not None and not teardown.finished(self._destroy_timeout_s):
            logger.error(
                "the process group of generation %s was not torn down within destroy_timeout_s=%ss; going on "
                "without it (what it holds stays held)", teardown.generation, self._destroy_timeout_s,
            )


class _Teardown(threading.Thread):
    """Aborts (NCCL) or shuts down (gloo) a left generation's groups and drops the last references to
    them, so that their destructors, which join c10d's threads, run here and not on the training thread."""

    def __init__(self, generation: int | None, groups: list[dist.ProcessGroup], backend: str, aborted: bool,
                 aborting: threading.Thread | None):
        super().__init__(daemon=True, name=f"elastic-train-teardown-{generation}")
        self.generation = generation
        self._groups, self._backend, self._aborted, self._aborting = groups, backend, aborted, aborting
        self._started_at = time.monotonic()
        self._done = threading.Event()

    def run(self) -> None:
        try:
            if self._backend == "gloo":
                for group in self._groups:
                    try:
                        group.shutdown()
                    except Exception as exc:  # noqa: BLE001 - an aborted group may refuse; it goes either way
                        logger.debug("shutdown of a group of generation %s: %s", self.generation, exc)
            elif self._aborting is not None:  # the abort under way tears the NCCL group down
                self._aborting.join()
            elif not self._aborted:
                _abort_groups(self._groups, self.generation)
            self._groups.clear()
        finally:
            self._done.set()

    def finished(self, timeout_s: float) -> bool:
        """Wait until the teardown is done, at most `timeout_s` after it started."""
        return self._done.wait(max(0.0, self._started_at + timeout_s - time.monotonic()))


def _export_env(assignment: Assignment) -> None:
    """The variables torchrun and Ray Train set, for the generation just joined: frameworks (Accelerate,
    Lightning) read the world and the device from them, and they change with every re-form."""
    os.environ.update({
        "ACCELERATE_TORCH_DEVICE": str(get_device()),
        "MASTER_ADDR": assignment.master_addr,
        "MASTER_PORT": str(assignment.master_port),
        "RANK": str(assignment.rank),
        "WORLD_SIZE": str(assignment.world_size),
        "LOCAL_RANK": str(assignment.local_rank),
        "LOCAL_WORLD_SIZE": str(assignment.local_world_size),
        "NODE_RANK": str(assignment.node_rank),
    })


def _abort_groups(groups: list[dist.ProcessGroup], generation: int | None) -> None:
    """Abort the communicators of `groups`, within one NCCL group call (as c10d's `_abort_process_group`
    does: separate aborts of several communicators can deadlock each other, pytorch/pytorch#119797)."""
    started = time.monotonic()
    nccl = None
    try:
        nccl = groups[0]._get_backend(torch.device("cuda")) if groups else None
    except RuntimeError:
        pass
    grouped = nccl is not None and hasattr(nccl, "_group_start")
    try:
        if grouped:
            nccl._group_start()
        for group in groups:
            group.abort()
        if grouped:
            nccl._group_end()
        logger.info("aborted the group of generation %s in %.3fs", generation, time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - an abort that fails leaves the teardown to the deadline
        logger.warning("abort of the group of generation %s: %s", generation, exc)


# -- c10d's registry ------------------------------------------------------------------------------
def _registered_groups() -> list[dist.ProcessGroup]:
    """The groups in c10d's registry, the newest first (the order `destroy_process_group` uses); not
    the WorldGroups over them (they hold no group of their own)."""
    names = dict(dist.distributed_c10d._world.pg_names)  # a copy: the loop's thread may add a group meanwhile
    return sorted((g for g in names if not isinstance(g, WorldGroup)), key=lambda group: names[group], reverse=True)


def _forget_groups() -> list[dist.ProcessGroup]:
    """Empty c10d's registry as `destroy_process_group()` does after shutting the backends down, and
    return the groups it held for a teardown elsewhere. A new default group can then be made at once."""
    c10d = dist.distributed_c10d
    world = c10d._world
    registries = (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state)
    unregister, update_default = c10d._unregister_all_process_groups, c10d._update_default_pg
    groups = _registered_groups()
    update_default(None)
    for registry in registries:
        registry.clear()
    unregister()
    world.group_count = 0
    return groups
