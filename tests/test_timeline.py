"""The timeline's world size follows the members: a fixed-size run waiting for a replacement is
drawn at its survivors' size until the next generation opens, not at the size it had."""

from __future__ import annotations

import pytest

from elastic_train.timeline import step_rate, world_over_time


@pytest.mark.timeout(10)
def test_the_world_drawn_drops_with_each_member_lost_until_the_next_generation_opens():
    events = [
        {"kind": "generation", "time": 0.0, "generation": 0, "world_size": 3},
        {"kind": "checkpoint_committed", "time": 1.0},
        {"kind": "worker_lost", "time": 2.0, "generation": 0, "rank": 1, "worker_id": 11},
        {"kind": "worker_lost", "time": 2.5, "generation": 0, "rank": -1, "worker_id": 13},  # a standby
        {"kind": "worker_lost", "time": 3.0, "generation": 0, "rank": 2, "worker_id": 12},
        {"kind": "worker_left", "time": 3.5, "generation": 0, "rank": 2, "worker_id": 12},  # the same one
        {"kind": "generation", "time": 6.0, "generation": 1, "world_size": 3},  # the replacements came
        {"kind": "worker_lost", "time": 7.0, "generation": 0, "rank": 0},  # late news of an older one
    ]
    assert world_over_time(events) == ([0.0, 2.0, 3.0, 6.0], [3, 2, 1, 3])
    assert world_over_time([]) == ([], [])


@pytest.mark.timeout(10)
def test_the_step_rate_is_averaged_over_a_window_of_reports():
    times = [0.0, 1.0, 2.0, 2.0, 3.0, 4.0]  # two reports at one instant do not spike the rate
    assert step_rate(times, window=2) == ([2.0, 2.0, 3.0, 4.0], [1.0, 2.0, 2.0, 1.0])
