"""The driver's pure decisions, without Ray: which trainer arguments are refused and how, and which
error `fit()` raises for the summary a run ended with."""

from __future__ import annotations

import pytest

from elastic_train.config import ScalingConfig
from elastic_train.driver.arguments import as_config, check_loop, checked_metadata, checked_options
from elastic_train.driver.outcome import failure
from elastic_train.errors import ConfigError, ControllerError, PreemptionError, WorkerGroupError
from elastic_train.protocol import PreemptionInfo
from elastic_train.run_folder.summary import RunSummary
from elastic_train.supervisor.state import RunState


def _summary(state: RunState = RunState.ERRORED, **fields) -> RunSummary:
    return RunSummary(state=state, error=fields.pop("error", "it broke"), metrics={}, metrics_history=[],
                      checkpoints=[], **fields)


@pytest.mark.timeout(10)
def test_a_config_is_taken_as_one_as_a_dict_of_its_options_or_as_its_defaults():
    given = ScalingConfig(num_workers=2)
    assert as_config(ScalingConfig, given, "scaling_config") is given
    assert as_config(ScalingConfig, {"num_workers": (1, 3)}, "scaling_config").max_workers == 3
    assert as_config(ScalingConfig, None, "scaling_config") == ScalingConfig()
    with pytest.raises(ConfigError, match="scaling_config must be an elastic_train.ScalingConfig or a dict of its options, got builtins.int"):
        as_config(ScalingConfig, 2, "scaling_config")
    with pytest.raises(ConfigError, match=r"no option 'use_gpus' \(did you mean 'use_gpu'\?\)"):
        checked_options(ScalingConfig, {"use_gpus": True})


@pytest.mark.timeout(10)
def test_the_loop_takes_its_config_in_its_one_positional_argument():
    assert check_loop(lambda config: None, {"lr": 0.1}) is True
    assert check_loop(lambda *args: None, None) is True
    assert check_loop(lambda: None, None) is False
    with pytest.raises(ConfigError, match="requires 2"):
        check_loop(lambda a, b: None, None)
    with pytest.raises(ConfigError, match="add a `config` parameter"):
        check_loop(lambda: None, {})


@pytest.mark.timeout(10)
def test_metadata_is_a_dict_that_json_can_hold():
    assert checked_metadata(None) == {}
    assert checked_metadata({"a": [1, "b"]}) == {"a": [1, "b"]}
    with pytest.raises(ConfigError, match="must be a dict"):
        checked_metadata([1])
    with pytest.raises(ConfigError, match="JSON-serializable"):
        checked_metadata({"a": object()})


@pytest.mark.timeout(10)
def test_the_error_fit_raises_follows_what_ended_the_run():
    assert failure(_summary(RunState.FINISHED, error=None)) is None
    lost = ValueError("bad batch")
    error = failure(_summary(worker_failures={1: lost}))
    assert isinstance(error, WorkerGroupError) and error.worker_failures == {1: lost}
    preempted = failure(_summary(preemption=PreemptionInfo(None, {"node": [0]})))
    assert isinstance(preempted, PreemptionError) and "it broke" in preempted.__notes__
    assert isinstance(failure(_summary()), ControllerError)
