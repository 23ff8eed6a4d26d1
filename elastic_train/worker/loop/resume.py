"""Where a generation's loop resumes from: the one reader of a `ResumePlan` (protocol.py).

The supervisor names a checkpoint, and which survivors serve which of its files from memory, or its
committed copy in storage; or the state a run keeps live (worker/hold/kept_state.py). `Resume` gives the loop
that checkpoint (`get_checkpoint()`) or state (`prepare_model`), each file served from memory checked
against the facts it was reported with; `part_to_store` is what a holder stores of a plan's checkpoint.
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist

from elastic_train.checkpoint.checkpoint import (STATE_FILE, Checkpoint, checkpoint_from_files, dict_from_bytes,
                                                 is_state_file, share_file, share_rank)
from elastic_train.checkpoint.manifest import file_problem
from elastic_train.errors import CheckpointError, CorruptCopy, PeerLost
from elastic_train.protocol import HeldCheckpoint, ResumePlan
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.hold.sharded_state import is_sharded, mesh_of, needed, reshard
from elastic_train.worker.hold.state_transfer import share
from elastic_train.worker.loop.host import SessionSetup, WorkerServices
from elastic_train.worker.store.queue import PartToStore

logger = logging.getLogger(__name__)


def part_to_store(plan: ResumePlan | None, worker_id: int, read: Callable[[int, int, list[str]], dict[str, bytes]],
                  *, final: bool = False) -> PartToStore | None:
    """This worker's files of `plan`'s checkpoint as a part to store: one chosen to be stored whose
    report's barrier failed before any rank stored it, or whose uploader was lost before it told its
    part stored (`plan.store`, into the folder it named), or with `final` the checkpoint a stopping
    run leaves behind. None where this worker holds none."""
    if plan is None or worker_id not in plan.holders or not (final or plan.store):
        return None
    try:
        files = read(plan.generation, plan.index, plan.holders[worker_id])
    except KeyError:
        if not final:
            raise
        return None  # no longer held as the run stops: nothing to store
    facts = {name: plan.facts[name] for name in files} if set(files) <= set(plan.facts) else None
    return PartToStore(plan.generation, plan.index, files, replaceable=False, final=final,
                       dir_name=None if final else plan.dir_name, facts=facts)


class Resume:
    """This generation's resume plan, applied for its session."""

    def __init__(self, setup: SessionSetup, host: WorkerServices):
        # The plan names its holders among the members of the generation it was made for: their handles
        # are that generation's, also once the loop went on in place into a later one without some of them.
        self._plan, self._peers = setup.context.assignment.resume, setup.context.assignment.peers
        self._setup, self._host = setup, host
        self._scratch: str | None = None  # where a loaded checkpoint's files were written

    @property
    def index(self) -> int:
        """The report index the loop's reports go on from."""
        return self._plan.index if self._plan else 0

    @property
    def state_only(self) -> bool:
        """Does this generation resume from a state kept live (no checkpoint for the loop to load)?"""
        return self._plan is not None and self._plan.state_only

    @property
    def loader_states(self) -> list[dict[str, Any]]:
        """The prepared data loaders' positions, in the order the loop prepares them."""
        return list(self._plan.loader_states) if self._plan else []

    def check_loaded(self, keeps_state: bool, loaded: bool) -> None:
        """A loop whose state is kept live that resumed from a checkpoint it reported (the newest there
        was) must have loaded it: its kept state was not restored, and going on from a fresh model at
        the checkpoint's data position would train a wrong model without a word."""
        plan = self._plan
        if not keeps_state or plan is None or plan.state_only or loaded:
            return
        raise CheckpointError(
            f"this generation resumed from checkpoint {plan.index}, the newest the loop reported, but the loop did not "
            "load it (get_checkpoint()) before its first report: prepare_model(live_state=True) restores only the state "
            "kept at reports without a checkpoint. Load get_checkpoint() in the loop, as Ray Train's guides do, or "
            "report no checkpoint in a loop whose state is kept live (return the final state instead).")

    def checkpoint(self) -> Checkpoint | None:
        """The checkpoint `get_checkpoint()` returns: from storage, or from the holders' memory."""
        plan = self._plan
        if plan is None:
            return self._setup.loop.initial_checkpoint
        if plan.state_only:  # restored into the model by prepare_model: nothing for the loop to load
            return None
        storage = self._setup.context.storage
        files = storage.read_verified(plan.stored) if plan.stored is not None else self._gather(plan)
        self._scratch = tempfile.mkdtemp(prefix="elastic_train_session_")
        return checkpoint_from_files(files, self._scratch)

    def kept_state(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """The kept state this generation resumes from, for `model`. A survivor has its own tensors
        (every rank's kept state is the same; none is serialized), or a copy a leaving peer handed it.
        A newcomer receives it from a survivor over the group (worker/hold/state_transfer.py), and holds it, the
        supervisor told before it goes on, until its first report: a survivor lost before then does
        not take the only copy with it. Over Ray only where no member holds it. A sharded model's is
        re-sharded from the old ranks' shares (`_resharded`)."""
        plan, host = self._plan, self._host
        if plan is None or not plan.state_only:
            return None
        names = sorted({name for names in plan.holders.values() for name in names})
        if names != [STATE_FILE]:
            return self._resharded(plan, len(names), model)
        own = host.held_state(plan.generation, plan.index)
        if own is None:
            try:
                own = dict_from_bytes(host.read_held(plan.generation, plan.index, [STATE_FILE])[STATE_FILE])
            except KeyError:
                pass
        state = share(own) if dist.is_initialized() and dist.get_world_size() > 1 else own
        if state is None:
            state = dict_from_bytes(self._gather(plan)[STATE_FILE])
        if own is None:
            held = HeldCheckpoint(plan.index, plan.generation, -1, [STATE_FILE], plan.loader_states)
            host.hold(held, LivePart(state, file=STATE_FILE), False, None)
            ray.get(host.supervisor.replica_held.remote(self._setup.worker_id, plan.generation, plan.index,
                                                        [STATE_FILE]))
        # Copies of the optimizers' tensors: the optimizer would take them as its own and write them,
        # and the held state must stay as reported while it may still serve a recovery.
        return {"model": state["model"], "optimizers": copy.deepcopy(state["optimizers"]), "objects": state["objects"]}

    def _resharded(self, plan: ResumePlan, old_world: int, model: torch.nn.Module) -> dict[str, Any]:
        """This rank's share of a sharded model's kept state at the new world, out of the old ranks'
        shares that hold its rows: its own, if it holds one of those, and the others read from the
        survivors that hold them (reported, or kept as a buddy's replica)."""
        if not is_sharded(model):
            raise CheckpointError(
                "this generation resumes from a sharded model's kept state, but the model handed to "
                "prepare_model(live_state=True) is not sharded: shard it as the loop did before "
                "(prepare_model(parallel_strategy='fsdp'), or fully_shard before prepare_model).")
        mesh = mesh_of(model)
        wanted = needed(model, old_world)
        shares: dict[int, dict[str, Any]] = {}
        own = self._host.held_state(plan.generation, plan.index)
        if own is not None and own["rank"] in wanted:
            shares[own["rank"]] = own
        missing = [share_file(rank) for rank in wanted if rank not in shares]
        if missing:
            for name, raw in self._gather(plan, missing).items():
                shares[share_rank(name)] = dict_from_bytes(raw)
        return reshard(shares, mesh)

    def _gather(self, plan: ResumePlan, names: list[str] | None = None) -> dict[str, bytes]:
        """The checkpoint's files (or those of `names`) from the memory of the survivors that hold
        them (this one included), each checked against the facts it was reported with. A holder lost
        meanwhile ends the generation (the next one resumes from what is left), as a lost peer does: it
        is no error of the loop's. So does a copy that is not what was reported (`_check_served`)."""
        worker_id, peers = self._setup.worker_id, self._peers
        holders = {holder: [n for n in held if names is None or n in names] for holder, held in plan.holders.items()}
        holders = {holder: held for holder, held in holders.items() if held}
        remote = [holder for holder in holders if holder != worker_id]
        refs = [peers[holder].read_checkpoint.remote(plan.generation, plan.index, holders[holder])
                for holder in remote]
        served: dict[int, dict[str, bytes]] = {}
        if worker_id in holders:
            served[worker_id] = self._host.read_held(plan.generation, plan.index, holders[worker_id])
        try:
            served.update(zip(remote, ray.get(refs)))
        except ray.exceptions.RayActorError as exc:
            raise PeerLost(f"a worker holding checkpoint {plan.index} was lost while this one fetched it: {exc}") from exc
        files: dict[str, bytes] = {}
        for holder, part in served.items():
            self._check_served(plan, holder, part)
            files.update(part)
        return files

    def _check_served(self, plan: ResumePlan, holder: int, part: dict[str, bytes]) -> None:
        """Is each file `holder` served what its report made? One that is not (memory corrupted, a
        file served under another's name) is never loaded: the supervisor hears of it, drops that
        copy, and ends the generation; the next one resumes from another copy, storage or an older
        checkpoint (the `checkpoint_copy_corrupt` event)."""
        for name in sorted(part):
            expected = plan.facts.get(name)
            if expected is None:  # a share of a kept state served from its reporter's memory: never serialized there
                log = logger.debug if is_state_file(name) else logger.warning
                log("%s of checkpoint %d, served from worker %d's memory, has no facts to check it against",
                    name, plan.index, holder)
                continue
            problem = file_problem(name, part[name], expected, "its report")
            if problem is not None:
                logger.error("checkpoint %d served from worker %d's memory is corrupt: %s", plan.index, holder, problem)
                ray.get(self._host.supervisor.copy_corrupt.remote(
                    self._setup.worker_id, self._setup.context.assignment.generation, plan.generation, plan.index,
                    holder, name, problem))
                raise CorruptCopy(f"checkpoint {plan.index} served from worker {holder}'s memory is corrupt: {problem}")

    def close(self) -> None:
        """Remove the loaded checkpoint's files from local disk."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
