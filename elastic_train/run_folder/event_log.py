"""The run's event log: `events.jsonl` in the run's folder, one JSON object a line, in order.

The supervisor writes it as the run goes, so that what happened (a worker lost and why, a resize,
a commit) can be read while the run is still going and after the driver died: batched, at most
every `ElasticConfig.event_log_interval_s`, off the supervisor's event loop, and at the end. On
local storage the new lines are appended; object stores cannot append, so there the file is
written whole each time (a run that commits a checkpoint every step adds a line a step: raise the
interval for very long runs on object stores). A supervisor that Ray restarted starts from the
lines its predecessor stored (it appends, it does not overwrite); a new `fit()` of a run with the
same name starts a new log. A write that fails is logged and tried again at the next flush (the
last flush, at the run's end, is not tried again): the log never fails a run that storage lets train.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ConfigError, StorageError
from elastic_train.events import Event
from elastic_train.run_folder.record import to_json

logger = logging.getLogger(__name__)

EVENT_LOG = "events.jsonl"


def read_events(storage: RunStorage) -> list[dict[str, Any]]:
    """The events stored in a run's folder ([] when there are none)."""
    return _read(storage)[0]


def _read(storage: RunStorage) -> tuple[list[dict[str, Any]], bool]:
    """The stored events, and whether the file ends whole (a write cut short by a crash leaves a
    last line without its newline: it is left out)."""
    raw = storage.read(EVENT_LOG)
    if raw is None:
        return [], True
    lines = raw.decode(errors="replace").split("\n")
    if lines[-1]:
        logger.warning("%s ends in a line cut short; it is left out", storage.url(EVENT_LOG))
    try:
        return [json.loads(line) for line in lines[:-1] if line], not lines[-1]
    except ValueError as exc:
        raise ConfigError(f"{storage.url(EVENT_LOG)} is not JSON lines ({exc}): the event log is damaged.") from exc


class EventLog:
    """The events of a run, in memory (`entries`) and in storage."""

    def __init__(self, storage: RunStorage, go_on: bool):
        """`go_on`: a restarted supervisor's log, which starts from the lines already stored."""
        self._storage = storage
        self.entries: list[dict[str, Any]] = []
        self._stored = -1  # how many entries storage holds (-1: the stored file is not this log's yet)
        if go_on:
            try:
                self.entries, whole = _read(storage)
                self._stored = len(self.entries) if whole else -1  # a torn tail: written whole again, not after
            except (ConfigError, StorageError) as exc:
                logger.warning("the stored event log could not be read; it is written anew: %s", exc)
        self.inherited = len(self.entries)  # the predecessor's entries
        self._writing = threading.Lock()  # one write at a time: flushes run on executor threads

    def on_event(self, event: Event, entry: dict[str, Any], now: float) -> None:
        self.entries.append(entry)

    async def write(self) -> None:
        """`flush` on an executor thread: the run's event loop goes on meanwhile."""
        await asyncio.get_running_loop().run_in_executor(None, self.flush)

    def flush(self) -> None:
        """Write the log whole if it has entries storage does not (blocking: run it off the event loop)."""
        with self._writing:
            count = len(self.entries)
            if count == self._stored:
                return
            append = self._stored >= 0 and self._storage.appends
            text = "".join(to_json(event) + "\n" for event in self.entries[self._stored if append else 0:count])
            try:
                if append:
                    self._storage.append_bytes(EVENT_LOG, text.encode())
                else:
                    self._storage.write_text(EVENT_LOG, text)
            except StorageError as exc:
                logger.warning("the event log was not written (tried again at the next flush): %s", exc)
                return
            self._stored = count
