"""Programs as users bring them (tests/faithful_programs.py), each holding something derived from its
world, run on real Ray with a worker SIGKILLed from outside mid-epoch: rank 0 in one run, rank 1 in
another, one of them fixed-size and the other elastic (both fixed where Ray's own semantics need the
size kept: a scheduler sized by `len(loader)`). Each run must compute what Ray Train's semantics compute for the program at the
world sizes it ran at (the program's checks) and train every sample once an epoch; it goes on in
place where that is faithful, and is re-entered, the event naming the program's line, where not. With
room for a warm spare, a fixed-size run re-enters at full size at the loss, the spare at the lost rank."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

import pytest

import elastic_train as et
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.events import GenerationOpened
from elastic_train.run_folder.event_log import read_events
from tests.faithful_programs import EPOCHS, OWN_DATA, PROGRAMS, every_sample_once_an_epoch
from tests.helpers import make_trainer
from tests.loops import read_progress

SIZED_BY_LEN = {"lambda_lr", "one_cycle_lr"}  # Ray's semantics keep their total only at one world size
HOLD_THEIR_WORLD = {"batch_from_world", "torch_and_environment_reads", "own_validation_sampler", "lambda_lr",
                    "one_cycle_lr", "per_rank_epoch_sums", "global_step_checkpoints", "metrics_all_reduced_by_hand",
                    "ddp_tutorial"}  # changed by any loss
READ_RANK_ONCE = {"rank_read_once", "rank_once_own_data", "every_rank_its_own_shard"}  # changed by rank 0's loss
BY_TIMING = {"all_reduce_of_a_world_share"}  # re-entered if the peer is lost in its all-reduce, else in place


def expected_path(name: str, victim: int) -> str:
    """Re-entered where the program holds what the recovery changes; else in place (rank 1 lost: rank 0
    keeps its number; rank 0 lost: a rank read where it is used answers anew)."""
    if name in BY_TIMING:
        return "either"
    if name in HOLD_THEIR_WORLD or (name in READ_RANK_ONCE and victim == 0):
        return "re-entered"
    return "in place"


def _cells() -> list[tuple[str, str, object, int]]:
    """Each program twice, rank 0 lost and rank 1 lost, one fixed-size run and one elastic, the pairing
    alternating from one program to the next (every combination is met, in half the runs)."""
    cells = []
    for i, name in enumerate(PROGRAMS):
        for victim in (0, 1):
            fixed = name in SIZED_BY_LEN or (victim == 0) == (i % 2 == 0)
            cells.append(pytest.param(name, 2 if fixed else (1, 2), victim,
                                      id=f"{name}-{'fixed' if fixed else 'elastic'}-rank{victim}"))
    return cells


class _Killer:
    """SIGKILLs the process of rank `victim` once it logged epoch 1's second step in generation 0; with
    `after`, at its first step in generation 0 from then on once `after()` is true (and before the last
    epoch)."""

    def __init__(self, log_dir: str, victim: int, after: Callable[[], bool] | None = None):
        self._log_dir, self._victim, self._after = log_dir, victim, after
        self._done = threading.Event()
        self.killed: int | None = None
        self.killed_at = 0.0
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            try:
                progress = read_progress(self._log_dir)
            except ValueError:  # a line being written
                continue
            for p in progress:
                if "batches" in p and p["generation"] == 0 and p["rank"] == self._victim and self._due(p):
                    self.killed, self.killed_at = p["pid"], time.time()
                    os.kill(p["pid"], signal.SIGKILL)
                    return

    def _due(self, p: dict) -> bool:
        if self._after is None:
            return (p["epoch"], p["step"]) == (1, 1)
        return (1, 1) <= (p["epoch"], p["step"]) and p["epoch"] < EPOCHS - 1 and self._after()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, scaling, victim", _cells())
def test_a_program_computes_what_ray_computes_through_a_kill(local_ray, run_dirs, name, scaling, victim):
    loop, checks = PROGRAMS[name]
    killer = _Killer(run_dirs["log_dir"], victim)
    try:
        result = make_trainer(run_dirs, scaling, loop).fit()
    finally:
        killer.stop()
    assert killer.killed is not None, "the fault was not injected"
    assert result.error is None, result.error
    if name not in OWN_DATA:
        every_sample_once_an_epoch(run_dirs["log_dir"], result)
    for check in checks:
        check(run_dirs["log_dir"], result)
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    recovery = opened[1]
    path = expected_path(name, victim)
    if path == "in place" or (path == "either" and recovery.resume_from == "in place"):
        assert recovery.resume_from == "in place", opened
    else:
        assert recovery.resume_from != "in place" and "faithful_programs.py:" in recovery.reentered_because, opened


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, victim", [("batch_from_world", 0), ("lambda_lr", 1), ("rank_read_once", 0),
                                          ("own_fast_forward", 1)])
def test_a_program_computes_what_ray_computes_when_a_warm_spare_replaces_the_lost_rank(data_ray, run_dirs, name,
                                                                                      victim):
    """A fixed-size run of 2 with room for its warm spare (4 CPUs): the rank is SIGKILLed once the spare
    is ready. Every loop re-enters at 2 from the newest checkpoint in memory, the spare at the lost rank,
    as Ray's restart at 2 does (whatever the program holds of its world), and the program computes what
    Ray's semantics compute. Steps of 0.3 s: the spare is ready within the run."""
    loop, checks = PROGRAMS[name]
    path = os.path.join(run_dirs["storage"], "run")

    def spare_ready() -> bool:
        seen = read_events(RunStorage.at(path)) if os.path.exists(path) else []
        first = next((e for e in seen if e["kind"] == "generation"), None)
        return first is not None and any(e["kind"] == "worker_ready" and str(e["worker_id"]) not in
                                         map(str, first["members"]) for e in seen)

    killer = _Killer(run_dirs["log_dir"], victim, after=spare_ready)
    try:
        result = make_trainer(run_dirs, 2, loop, step_time=0.3,
                              elastic=et.ElasticConfig(warm_spares_after_s=0)).fit()  # its spare from the start
    finally:
        killer.stop()
    assert killer.killed is not None, "the fault was not injected: the spare was not ready before the last epoch"
    assert result.error is None, result.error
    every_sample_once_an_epoch(run_dirs["log_dir"], result)
    for check in checks:
        check(run_dirs["log_dir"], result)
    opened = [GenerationOpened.of(e) for e in read_events(RunStorage.at(result.path)) if e["kind"] == "generation"]
    first, recovery = opened[0], opened[1]
    assert (recovery.world_size, recovery.resume_from) == (2, "memory"), opened
    before = {str(w): m["rank"] for w, m in first.members.items()}
    after = {str(w): m["rank"] for w, m in recovery.members.items()}
    lost = next(str(w) for w, m in first.members.items() if m["pid"] == killer.killed)
    (spare,) = set(after) - set(before)  # a worker of no earlier generation: the spare, ready before the kill
    assert any(e["kind"] == "worker_ready" and str(e["worker_id"]) == spare and e["time"] < killer.killed_at
               for e in read_events(RunStorage.at(result.path)))
    assert after[spare] == before[lost] == victim
    assert all(after[w] == before[w] for w in after if w != spare)  # the survivor keeps its rank
