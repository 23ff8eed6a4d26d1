"""The run's typed events: each kind's dict form (events.jsonl, the driver's feed) reads back as the
same value, readers of another kind get None, and a log written by an older version still reads."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic_train import events
from elastic_train.events import KINDS, GenerationOpened, StateChanged, WorkerLost


def _sample(cls: type[events.Event]) -> events.Event:
    values = {int: 3, float: 0.5, str: "x", bool: True}
    kwargs = {}
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        kwargs[f.name] = (next((v for t, v in values.items() if kind.startswith(t.__name__)), None)
                          if not kind.startswith(("list", "dict")) else ([] if kind.startswith("list") else {}))
    return cls(**kwargs)


@pytest.mark.timeout(10)
def test_every_kind_has_one_class_and_reads_back_from_its_json_line():
    assert len(KINDS) == len({cls.kind for cls in KINDS.values()}) >= 28 and "" not in KINDS
    for kind, cls in KINDS.items():
        event = _sample(cls)
        entry = json.loads(json.dumps(event.entry(t=1.5, time=1e9)))
        assert entry["kind"] == kind and entry["t"] == 1.5 and entry["time"] == 1e9
        assert cls.of(entry) == event
        others = [other for other in KINDS.values() if other is not cls]
        assert all(other.of(entry) is None for other in others)


@pytest.mark.timeout(10)
def test_optional_details_are_left_out_and_missing_fields_read_as_none():
    entry = StateChanged("RUNNING", "RESTARTING", reason="worker lost").entry(t=0.0, time=0.0)
    assert entry == {"t": 0.0, "time": 0.0, "kind": "state", "source": "RUNNING", "target": "RESTARTING",
                     "reason": "worker lost"}
    first = GenerationOpened(0, 2, {}).entry(t=0.0, time=0.0)
    assert first["resume_from"] is None and first["resume_index"] is None  # always there: readers index them
    old = {"kind": "generation", "generation": 1, "world_size": 2}  # an older log: no members, no resume fields
    assert GenerationOpened.of(old) == GenerationOpened(1, 2, None)
    assert WorkerLost.of({"kind": "worker_lost", "worker_id": 1}).reason == ""
