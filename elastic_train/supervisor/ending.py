"""The run's end, once its state is FINISHED or ERRORED: a failed run's members leave their
generation first (their last reports count); the newest checkpoint that only memory holds is chosen
to be stored (`policy.final_flush`); every worker is stopped with it, the commits under way are
waited for (within `drain_timeout_s`, plus `store_flush_timeout_s` when there is a flush), and
whatever has not ended by then is ended."""

from __future__ import annotations

import asyncio
import time

from elastic_train.config import ElasticConfig
from elastic_train.events import RunEnded
from elastic_train.protocol import ResumePlan, Stop
from elastic_train.supervisor import policy
from elastic_train.supervisor.checkpoints.commits import Commits
from elastic_train.supervisor.checkpoints.ledger import CheckpointLedger
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunState
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry


class RunEnding:
    def __init__(self, elastic: ElasticConfig, roster: Roster, ledger: CheckpointLedger, commits: Commits,
                 tasks: Tasks, telemetry: Telemetry):
        self._elastic = elastic
        self._roster = roster
        self._ledger = ledger
        self._commits = commits
        self._tasks = tasks
        self._telemetry = telemetry
        self.flush: ResumePlan | None = None  # what the workers store before they stop
        self.decided = asyncio.Event()  # `flush` is chosen: no report is recorded after it

    async def stop(self) -> Stop:
        """A worker that parks once the run is over waits here for its Stop."""
        await self.decided.wait()
        return Stop("run is over", flush=self.flush)

    def _stop(self, state: RunState) -> Stop:
        return Stop("run finished" if state is RunState.FINISHED else "run failed", flush=self.flush)

    async def carry_out(self, state: RunState, leaving: list[WorkerRecord], abort: bool = False) -> None:
        """End the run in `state`; `leaving`: a failed run's members told to leave their generation;
        `abort`: every worker is ended at once, and nothing more is stored."""
        if abort:
            self._roster.end_all(self._stop(state), now=True)
        await self._telemetry.until(lambda: all(m.outcome is not None or m.status is WorkerStatus.LOST
                                                for m in leaving), self._elastic.drain_timeout_s)
        live = self._roster.live_ids()
        newest = self._ledger.resume_plan(live, self._roster.holds())
        stored = self._commits.newest
        self.flush = None if abort else policy.final_flush(
            newest, stored.index if stored else 0, self._ledger.entries.get(newest.index) if newest else None,
            live=live, failed=state is RunState.ERRORED)
        self.decided.set()
        self._roster.end_all(self._stop(state), now=False)
        # Members leave after flushing their last checkpoint; its commit is a task of its own.
        await self._tasks.wait(time.monotonic() + self._elastic.drain_timeout_s + (
            self._elastic.store_flush_timeout_s if self.flush is not None else 0.0))
        self._roster.end_all(self._stop(state), now=True)  # whatever has not ended by now is ended here
        await self._commits.close(self._elastic.storage_retry_deadline_s)
        self._telemetry.record(RunEnded(state.value))  # last: every commit of the run is logged before it
