"""What the fault tests share: building a trainer over a test loop, and watching a run from outside."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import elastic_train as et
from elastic_train.trainer import attach
from tests.loops import linear_regression_loop


def make_trainer(
    run_dirs: dict,
    num_workers: int | tuple[int, int],
    loop: Callable = linear_regression_loop,
    *,
    use_gpu: bool = False,
    max_failures: int = 0,
    elastic: et.ElasticConfig | None = None,
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
