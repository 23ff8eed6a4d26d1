"""What the fault tests share: building a trainer over a test loop, watching a run from outside, and
running gloo ranks as plain processes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

import ray
import torch.multiprocessing as mp

import elastic_train as et
from elastic_train.driver.launch import attach
from tests.loops import linear_regression_loop


def make_trainer(
    run_dirs: dict,
    num_workers: int | tuple[int, int],
    loop: Callable = linear_regression_loop,
    *,
    use_gpu: bool = False,
    max_failures: int = 0,
    elastic: et.ElasticConfig | None = None,
    datasets: dict[str, Any] | None = None,
    **config: Any,
) -> et.TorchTrainer:
    """A trainer for `loop` with `config` plus the run's log dir, storing under the test's folder."""
    return et.TorchTrainer(
        loop,
        train_loop_config={"log_dir": run_dirs["log_dir"], **config},
        scaling_config=et.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=et.RunConfig(
            storage_path=run_dirs["storage"],
            name="run",
            failure_config=et.FailureConfig(max_failures=max_failures),
            elastic_config=elastic,
        ),
        datasets=datasets,
    )


def fit_in_background(trainer: et.TorchTrainer) -> Callable[[float], et.Result]:
    """Start `fit()` in a thread; returns a function that waits for its Result (or raises its error)."""
    results: dict = {}

    def fit() -> None:
        try:
            results["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            results["raised"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()

    def join(timeout: float) -> et.Result:
        thread.join(timeout)
        if "raised" in results:
            raise results["raised"]
        assert "result" in results, f"fit() did not return within {timeout}s"
        return results["result"]

    return join


@contextlib.contextmanager
def surfacing_the_runs_error(join: Callable[[float], et.Result]) -> Iterator[None]:
    """A test following a run from outside asks its supervisor; once the run ended (fit() killed it)
    that call raises ActorDiedError. Raise what fit() raised instead: the run's own error."""
    try:
        yield
    except ray.exceptions.RayActorError as lost:
        join(60)  # raises fit()'s error, if it raised one
        raise AssertionError("the run's supervisor is gone, but fit() returned a result") from lost


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `predicate` until it returns something truthy: the test's own observation of the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def supervisor_alive(run_name: str) -> bool:
    """Is the run's supervisor alive (a dead driver's goes with it)? Found from this process as from any."""
    try:
        attach(run_name)
    except ValueError:
        return False
    return True


def run_gloo_ranks(target: Callable[..., None], world: int, args_of: Callable[[int], tuple],
                   timeout_s: float) -> list[Any]:
    """Run `target(rank, port, *args_of(rank), conn)` in a spawned process per rank, the ranks forming
    a group over 127.0.0.1:`port`; returns what each rank sent on `conn`, by rank."""
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=target, args=(r, port, *args_of(r), pipes[r][1]), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = []
        for receiver, _ in pipes:
            assert receiver.poll(timeout_s), "a rank reported nothing in time"
            results.append(receiver.recv())
        return results
    finally:
        for p in procs:
            p.kill()
            p.join(timeout_s)
