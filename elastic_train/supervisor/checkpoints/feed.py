"""What the driver's callbacks see of the reports: every report all ranks made, in order, each once
its checkpoint is settled.

Why hold a report back: Ray Train's callbacks get a checkpoint "that has been persisted to
storage", and a Tune trial that saw a checkpoint path must be able to read it. Why in order: a later
report must not overtake an earlier one whose upload is still under way (Tune would see epoch 3
before epoch 2). A checkpoint that can never be stored (its generation ended, a part was given up)
settles with none, so nothing waits forever.
"""

from __future__ import annotations

from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.protocol import ReportRecord


class ReportFeed:
    def __init__(self) -> None:
        self._records: list[ReportRecord] = []
        self._awaiting: dict[tuple[int, int], ReportRecord] = {}  # (generation, index) -> its record
        self._ready = 0  # records before this position are settled

    def made(self, record: ReportRecord, awaits_commit: bool) -> None:
        """Every rank made a report; `awaits_commit`: its checkpoint is on its way to storage."""
        self._records.append(record)
        if awaits_commit:
            self._awaiting[(record.generation, record.index)] = record
        self._advance()

    def settle(self, generation: int, index: int, checkpoint: CommittedCheckpoint | None) -> None:
        """The checkpoint of report `index` of `generation` was committed (or never will be: None)."""
        record = self._awaiting.pop((generation, index), None)
        if record is not None:
            record.checkpoint = checkpoint
            self._advance()

    def awaiting(self) -> list[tuple[int, int]]:
        """(generation, index) of the reports whose checkpoint is still on its way."""
        return list(self._awaiting)

    def settle_all(self) -> None:
        """The run is over: what has not committed by now never will."""
        self._awaiting.clear()
        self._advance()

    def since(self, cursor: int) -> list[ReportRecord]:
        """The settled records from position `cursor` on."""
        return self._records[cursor : self._ready]

    @property
    def done(self) -> bool:
        return self._ready == len(self._records)

    def _advance(self) -> None:
        while self._ready < len(self._records):
            record = self._records[self._ready]
            if self._awaiting.get((record.generation, record.index)) is record:
                return
            self._ready += 1
