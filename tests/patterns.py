"""The checkpoint-pattern matrix: one training loop whose checkpoint pattern, collective and fault
are chosen by config, its exact fault-free trajectory computed in the test process, and the checks.

The model is `Linear(4, 1, bias=False)` in float64 trained by SGD with momentum on a global batch
of 4 small-integer samples per step, split over the ranks. Every value it ever holds is a dyadic
rational (sums of small integers divided by 4, times 0.5), so the arithmetic is exact whatever the
world size or the order of the sums: the state after step `s` of any correct run equals
`trajectory(s)` exactly, computed here in pure Python. A resume from a wrong or torn checkpoint, a
step skipped or applied twice, or a lost optimizer state shows up as a wrong state.

Every rank logs one line per computed step (before its report) with the state it holds, so the
test sees every step of every process: which generation computed it and what the state was.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import elastic_train as train
from elastic_train import Checkpoint, ElasticConfig, FailureConfig, RunConfig, ScalingConfig
from elastic_train.torch import TorchTrainer, prepare_model
from tests.loops import log_progress

D = 4  # features: the model has D weights
G = 4  # samples in a step's global batch
LR, MOMENTUM = 0.5, 0.5

# kept: none, its state kept live; fsdp: FSDP2 sharded by the loop, DCP saved by every rank (Ray's FSDP2
# guide), fsdp_async: the same with dcp.async_save
PATTERNS = ("rank0", "same_name", "shard", "dcp", "none", "kept", "fsdp", "fsdp_async")
COLLECTIVES = ("ddp", "allreduce", "none", "fsdp")  # fsdp: FSDP2's own (the fsdp patterns alone)


# == the exact fault-free trajectory ===============================================================
def sample(step: int, i: int) -> list[int]:
    """Sample `i` of step `step`'s global batch: small integers."""
    return [((step * 5 + i * 3 + j * 7) % 9) - 4 for j in range(D)]


def initial_weights() -> list[float]:
    return [0.25 * (j + 1) for j in range(D)]


def trajectory(steps: int) -> dict[int, tuple[list[float], list[float]]]:
    """(weights, momentum buffer) after each step 1..steps of a fault-free run, in pure Python.

    The loss of a sample x is w.x, so its gradient is x and the step's gradient is the batch mean.
    """
    w, buf, out = initial_weights(), None, {}
    for step in range(1, steps + 1):
        grad = [sum(sample(step, i)[j] for i in range(G)) / G for j in range(D)]
        buf = list(grad) if buf is None else [MOMENTUM * b + g for b, g in zip(buf, grad)]
        w = [wj - LR * bj for wj, bj in zip(w, buf)]
        out[step] = (w, buf)
    return out


# == faults, injected by the loop itself, once ====================================================
def _create_once(path: Path, record: dict) -> bool:
    """Create `path` holding `record` unless it exists: atomic (link of a finished temp file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(json.dumps(record))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def inject_fault(config: dict, step: int) -> None:
    """The configured fault at the start of step `fault["at_step"]`, once per run.

    kinds: "kill" (SIGKILL), "term" (SIGTERM: a preemption notice), "stop" (SIGSTOP; the harness
    may SIGCONT it later), "exit" (os._exit(1)) to `fault["rank"]`; "raise": a RuntimeError on every
    rank of the generation that first reaches the step (one bug, hit by the whole group, once).
    """
    fault = config.get("fault")
    if not fault or step != fault["at_step"]:
        return
    ctx = train.get_context()
    rank, generation = ctx.get_world_rank(), ctx.get_generation()
    marker = Path(config["log_dir"]) / "fault.json"
    record = {"pid": os.getpid(), "time": time.time(), "step": step, "rank": rank, "generation": generation,
              "kind": fault["kind"]}
    if fault["kind"] == "raise":
        if _create_once(marker, record) or json.loads(marker.read_text())["generation"] == generation:
            log_progress(config["log_dir"], raised=step, rank=rank, generation=generation)
            raise RuntimeError(f"injected bug at step {step} on rank {rank}")
        return
    if rank != fault["rank"] or not _create_once(marker, record):
        return
    if fault["kind"] == "exit":
        os._exit(1)
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[fault["kind"]]
    os.kill(os.getpid(), sig)


def read_fault(log_dir: str | Path) -> dict | None:
    path = Path(log_dir) / "fault.json"
    return json.loads(path.read_text()) if path.exists() else None


# == the loop ======================================================================================
def _my_samples(step: int, rank: int, world: int) -> torch.Tensor:
    return torch.tensor([sample(step, i) for i in range(rank, G, world)], dtype=torch.float64)


def _shard_bounds(rank: int, world: int) -> tuple[int, int]:
    per = -(-D // world)
    return min(rank * per, D), min((rank + 1) * per, D)


def _load_shards(d: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Reassemble the weights and momentum from every rank's shard file; any world size wrote them."""
    shards = [torch.load(os.path.join(d, n), weights_only=True) for n in sorted(os.listdir(d))
              if n.startswith("shard_")]
    steps = {s["step"] for s in shards}
    covered = sorted((s["start"], s["end"]) for s in shards)
    if len(steps) != 1 or [i for a, b in covered for i in range(a, b)] != list(range(D)):
        raise RuntimeError(f"torn sharded checkpoint: files {sorted(os.listdir(d))}, steps {steps}, "
                           f"ranges {covered}")
    w, buf = torch.zeros(1, D, dtype=torch.float64), torch.zeros(1, D, dtype=torch.float64)
    for s in shards:
        w[0, s["start"]:s["end"]] = s["w"]
        buf[0, s["start"]:s["end"]] = s["buf"]
    return steps.pop(), w, buf


class Column(torch.nn.Module):
    """`Linear(D, 1, bias=False)` with its weight as a column (D, 1), so that FSDP2 shards it by rows
    over the ranks (a row weight (1, D) would put it all on rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(initial_weights(), dtype=torch.float64).unsqueeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class AppState(Stateful):
    """Ray's FSDP2 guide's `AppState`: the model and optimizer through DCP's `get_state_dict`, and the step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def _full_row(t: torch.Tensor) -> list[float]:
    """A weight or momentum buffer as the list of its D values, whole (an FSDP2 shard gathered)."""
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().flatten().tolist()


def pattern_loop(config: dict) -> None:
    """config: pattern (PATTERNS), collective (COLLECTIVES), steps, step_time, fault, log_dir."""
    import torch.distributed as dist

    from elastic_train.torch.state import load_state, save_state

    pattern, collective = config["pattern"], config["collective"]
    ctx = train.get_context()
    rank, world, generation = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_generation()

    if pattern.startswith("fsdp"):  # the loop shards the model itself, as Ray's FSDP2 guide does
        model = net = Column()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    else:
        model = torch.nn.Linear(D, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([initial_weights()], dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if pattern == "kept":  # no checkpoint: the model and optimizer are kept live, restored in place
        net = prepare_model(model, live_state=True, parallel_strategy="ddp" if collective == "ddp" else None)
    elif not pattern.startswith("fsdp"):
        net = prepare_model(model) if collective == "ddp" else model
    app = AppState(model, optimizer)

    start = ctx.get_resume_index() if pattern == "kept" else 0  # one report per step
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            if pattern in ("rank0", "same_name"):
                state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                start = state["step"]
            elif pattern == "shard":
                start, w, buf = _load_shards(d)
                with torch.no_grad():
                    model.weight.copy_(w)
                optimizer.load_state_dict({"state": {0: {"momentum_buffer": buf}},
                                           "param_groups": optimizer.state_dict()["param_groups"]})
            elif pattern == "dcp":
                start = load_state(d, net, optimizer)["step"]
            elif pattern.startswith("fsdp"):
                dcp.load({"app": app}, checkpoint_id=d)
                start = app.step
            else:
                raise AssertionError(f"pattern {pattern!r} reports no checkpoint, yet got {os.listdir(d)}")
        log_progress(config["log_dir"], restored=start, rank=rank, world=world, generation=generation)

    for step in range(start + 1, config["steps"] + 1):
        inject_fault(config, step)
        if collective == "none":  # every rank computes the whole step itself: no communication at all
            x, scale = torch.tensor([sample(step, i) for i in range(G)], dtype=torch.float64), 1.0 / G
        else:
            x = _my_samples(step, rank, world)
            scale = world / G if collective in ("ddp", "fsdp") else 1.0 / G  # DDP and FSDP2 average the ranks' gradients
        loss = scale * net(x).sum()
        optimizer.zero_grad()
        loss.backward()
        if collective == "allreduce":
            dist.all_reduce(model.weight.grad)
        optimizer.step()
        w, buf = _full_row(model.weight), _full_row(optimizer.state[model.weight]["momentum_buffer"])
        app.step = step
        time.sleep(config.get("step_time", 0.0))
        log_progress(config["log_dir"], rank=rank, world=world, generation=generation, step=step, w=w, buf=buf)

        metrics = {"step": step, "w": w}
        with tempfile.TemporaryDirectory() as d:
            writes = True
            if pattern in ("rank0", "same_name"):
                writes = pattern == "same_name" or rank == 0  # rank0: Ray Train's usual pattern
                if writes:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                               os.path.join(d, "model.pt"))
            elif pattern == "shard":
                a, b = _shard_bounds(rank, world)
                torch.save({"step": step, "start": a, "end": b, "w": model.weight.detach()[0, a:b].clone(),
                            "buf": optimizer.state[model.weight]["momentum_buffer"][0, a:b].clone()},
                           os.path.join(d, f"shard_{rank}.pt"))
            elif pattern == "dcp":
                save_state(d, net, optimizer, extra={"step": step})
            elif pattern == "fsdp":  # every rank its shards; rank 0 alone writes .metadata
                dcp.save({"app": app}, checkpoint_id=d)
            elif pattern == "fsdp_async":
                dcp.async_save({"app": app}, checkpoint_id=d).result()
            else:
                writes = False
            train.report(metrics, checkpoint=Checkpoint.from_directory(d) if writes else None)


# == a cell of the matrix ==========================================================================
FAST_DETECTION = dict(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0, min_workers_timeout_s=30.0)


@dataclass
class Cell:
    pattern: str
    fault: str  # kill_ckpt, kill_other, term, stop, raise; "none": a fault-free run
    scaling: Any  # 2 or (1, 2)
    collective: str
    rank: int = 0  # the target of term/stop (kill_ckpt/kill_other pick their own)
    resume_after_s: float | None = None  # stop: SIGCONT this long after the SIGSTOP; None: never
    max_failures: int = 0
    expect_error: bool = False  # the run must fail, as its FailureConfig says
    steps: int = 20
    at_step: int = 6
    step_time: float = 0.1
    notes: list = field(default_factory=list)

    @property
    def id(self) -> str:
        scaling = "fixed2" if self.scaling == 2 else "1to2"
        fault = self.fault
        if self.fault in ("term", "stop"):
            fault += f"{self.rank}"
        if self.fault == "stop":
            fault += "-cont" if self.resume_after_s is not None else "-forever"
        if self.fault == "raise":
            fault += f"-maxf{self.max_failures}"
        return f"{self.pattern}-{fault}-{scaling}-{self.collective}"

    @property
    def target_rank(self) -> int | None:
        if self.fault == "kill_ckpt":
            return 0  # the rank that writes the checkpoint (rank 0 writes in every pattern)
        if self.fault == "kill_other":
            return 1  # in the rank0 pattern, the rank that writes none
        if self.fault in ("term", "stop"):
            return self.rank
        return None

    def fault_config(self) -> dict | None:
        if self.fault == "none":
            return None
        kind = {"kill_ckpt": "kill", "kill_other": "kill", "term": "term", "stop": "stop", "raise": "raise"}[self.fault]
        return {"kind": kind, "rank": self.target_rank, "at_step": self.at_step}


def cell_trainer(run_dirs: dict, cell: Cell) -> TorchTrainer:
    return TorchTrainer(
        pattern_loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], "pattern": cell.pattern, "collective": cell.collective,
                           "steps": cell.steps, "step_time": cell.step_time, "fault": cell.fault_config()},
        scaling_config=ScalingConfig(num_workers=cell.scaling),
        run_config=RunConfig(name="run", storage_path=run_dirs["storage"],
                             failure_config=FailureConfig(max_failures=cell.max_failures),
                             elastic_config=ElasticConfig(**FAST_DETECTION)),
    )


def run_cell(run_dirs: dict, cell: Cell, timeout_s: float = 75.0) -> train.Result:
    """fit() the cell's run; a SIGSTOPped worker is SIGCONTed `resume_after_s` after it stopped."""
    results: dict = {}

    def fit() -> None:
        try:
            results["result"] = cell_trainer(run_dirs, cell).fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            results["raised"] = exc

    fitter = threading.Thread(target=fit, daemon=True)
    fitter.start()
    deadline = time.monotonic() + timeout_s
    continued = False
    while fitter.is_alive() and time.monotonic() < deadline:
        fitter.join(0.1)
        fault = read_fault(run_dirs["log_dir"]) if cell.fault == "stop" else None
        if fault and not continued and cell.resume_after_s is not None \
                and time.time() > fault["time"] + cell.resume_after_s:
            _signal(fault["pid"], signal.SIGCONT)
            continued = True
    fault = read_fault(run_dirs["log_dir"])
    if cell.fault == "stop" and fault and not continued:
        _signal(fault["pid"], signal.SIGCONT)  # never woken during the run: let it end with the cluster
    if "raised" in results:
        raise results["raised"]
    assert "result" in results, f"fit() did not return within {timeout_s}s"
    return results["result"]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# == what the log shows ============================================================================
def step_lines(progress: list[dict], result: train.Result) -> list[dict]:
    """Progress lines of computed steps, without the stale ones: those a worker wrote in a
    generation after it was declared lost from it (a frozen worker woken later; its reports are refused)."""
    lost = {(e["pid"], e["generation"]): e["time"] for e in result.events if e["kind"] == "worker_lost"}
    return [p for p in progress if "step" in p
            and not ((p["pid"], p["generation"]) in lost and p["time"] > lost[(p["pid"], p["generation"])])]


def steps_redone(lines: list[dict]) -> int:
    """Steps computed in more than one generation (each extra generation counts once)."""
    generations: dict[int, set[int]] = {}
    for p in lines:
        generations.setdefault(p["step"], set()).add(p["generation"])
    return sum(len(g) - 1 for g in generations.values())


def wrong_states(lines: list[dict], steps: int) -> list[str]:
    """Lines whose state differs from the fault-free run's state after that step."""
    expected = trajectory(steps)
    return [f"rank {p['rank']} gen {p['generation']} step {p['step']}: w={p['w']} buf={p['buf']}, "
            f"expected w={expected[p['step']][0]} buf={expected[p['step']][1]}"
            for p in lines if [p["w"], p["buf"]] != [*map(list, expected[p["step"]])]]


def fault_free_losses(model: torch.nn.Module, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], steps: int,
                      scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> dict[int, float]:
    """The losses of a fault-free run, in this process: AdamW on `model`, MSE on each step's global
    batch (its ranks' equal shares, averaged, are the whole batch), with `scheduler` if given."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepped = scheduler(optimizer) if scheduler is not None else None
    out = {}
    for step in range(1, steps + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if stepped is not None:
            stepped.step()
        out[step] = loss.item()
    return out


def assert_losses(lines: list[dict], expected: dict[int, float], timeline: str, tolerance: float = 1e-5) -> None:
    """Every step redone at the same world size has the loss it had the first time; every step, the
    fault-free run's loss (within `tolerance`, relative)."""
    first = {}
    for p in lines:
        again = first.setdefault((p["step"], p["world"]), p["loss"])
        assert p["loss"] == again, f"step {p['step']} redone with loss {p['loss']}, first {again}\n{timeline}"
    wrong = [f"gen {p['generation']} world {p['world']} step {p['step']}: {p['loss']} != {expected[p['step']]}"
             for p in lines if abs(p["loss"] - expected[p["step"]]) > tolerance * abs(expected[p["step"]])]
    assert not wrong, "\n".join(wrong) + f"\n{timeline}"


def summary(result: train.Result) -> str:
    """The run's timeline, for assertion messages."""
    keep = ("generation", "worker_lost", "preemption_notice", "failure", "state", "resize_requested")
    commits = [e for e in result.events if "commit" in e["kind"] or "given_up" in e["kind"]]
    shown = {id(e) for e in commits[-3:]}  # the last commits: where the run's final checkpoint stands
    out = []
    for e in result.events:
        if e["kind"] in keep or id(e) in shown:
            details = {k: v for k, v in e.items() if k not in ("t", "time", "kind", "members", "detail")}
            out.append(f"{e['t']:.2f} {e['kind']} {details}")
    return "\n".join(out)


def checkpoint_state(checkpoint: Checkpoint, pattern: str) -> tuple[int, list[float], list[float]]:
    """(step, weights, momentum buffer) held by a checkpoint of `pattern`, read in the test process."""
    from elastic_train.torch.state import load_state

    with checkpoint.as_directory() as d:
        if pattern in ("rank0", "same_name"):
            state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
            return (state["step"], state["model"]["weight"][0].tolist(),
                    state["optimizer"]["state"][0]["momentum_buffer"][0].tolist())
        if pattern == "shard":
            step, w, buf = _load_shards(d)
            return step, w[0].tolist(), buf[0].tolist()
        if pattern.startswith("fsdp"):
            whole = os.path.join(tempfile.mkdtemp(), "whole.pt")
            dcp_to_torch_save(d, whole)
            state = torch.load(whole, weights_only=False)["app"]
            return (state["step"], state["model"]["weight"].flatten().tolist(),
                    state["optim"]["state"]["weight"]["momentum_buffer"].flatten().tolist())
        if pattern == "dcp":
            model = torch.nn.Linear(D, 1, bias=False, dtype=torch.float64)
            optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            step = load_state(d, model, optimizer)["step"]
            return step, model.weight.detach()[0].tolist(), optimizer.state[model.weight]["momentum_buffer"][0].tolist()
    raise AssertionError(f"pattern {pattern!r} writes no checkpoint")
