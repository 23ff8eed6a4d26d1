"""The supervisor's pure decisions, over the combinations the Ray tests sample (no Ray here)."""

from __future__ import annotations

import pytest

from elastic_train.supervisor.policy import Progress, Stall, stalled


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "progress, now, timeout, expected",
    [
        # The watchdog is off, or someone reported within the timeout: nothing to do.
        ([Progress(0, 5, 0.0), Progress(1, 4, 0.0)], 100.0, None, Stall()),
        ([Progress(0, 5, 99.0), Progress(1, 4, 0.0)], 100.0, 3.0, Stall()),
        ([], 100.0, 3.0, Stall()),
        # Stalled: the rank behind the others is hung (a loop without a collective; others wait at report).
        ([Progress(0, 5, 90.0), Progress(1, 4, 80.0)], 100.0, 3.0, Stall(hung=(1,))),
        ([Progress(0, 5, 90.0), Progress(1, 4, 80.0), Progress(2, 4, 80.0), Progress(3, 5, 90.0)], 100.0, 3.0,
         Stall(hung=(1, 2))),
        # Stalled with every rank at the same report (all stuck in one collective): abort the generation.
        ([Progress(0, 5, 90.0), Progress(1, 5, 90.0)], 100.0, 3.0, Stall(restart=True)),
        ([Progress(0, 0, 50.0)], 100.0, 3.0, Stall(restart=True)),
        # Exactly at the timeout is not yet a stall.
        ([Progress(0, 5, 97.0), Progress(1, 4, 0.0)], 100.0, 3.0, Stall()),
    ],
)
def test_stalled_generation(progress, now, timeout, expected):
    assert stalled(progress, now, timeout) == expected
