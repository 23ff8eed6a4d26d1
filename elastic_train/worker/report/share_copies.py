"""When a sharded model's kept state is copied (worker/hold/sharded_state.py): the reports at which every rank
copies its share, and when a buddy's older copies of its peer's share go.

Copying and sending a share costs memory bandwidth at every report it is made at: `ShareCadence`
spaces the copies so that they take at most `ElasticConfig.sharded_state_budget` of the loop's time.
Every rank copies at the same reports, agreed in one small all-reduce at every report
(`report_barrier.every_rank`), for a report is resumed from only where every rank's share of it is
held. The same all-reduce tells whether every rank's newest share reached its buddy; from then on
the buddies' older replicas add nothing and go (worker/hold/holdings.py, docs/sharded_state.md).
"""

from __future__ import annotations

import time
from typing import Callable

from elastic_train.errors import PeerLost
from elastic_train.worker.hold.live_part import LivePart
from elastic_train.worker.loop.host import WorkerServices
from elastic_train.worker.report.barrier import every_rank


class ShareCadence:
    """When a report copies this rank's share: at the first report, then once the time since the last
    copy began is at least a copy's cost (the copy, and its replication to the buddy) over `budget`,
    the share of the loop's time it may take; never while the last copy is still on its way (so no
    copy waiting for the replicator is replaced before the buddy has it). The cost is the lower of
    the last two copies': the first copy to a buddy pays for setting up the connection, and one slow
    copy (a pause of the machine) should not hold the next ones back."""

    def __init__(self, budget: float):
        self._budget = budget
        self._last: tuple[float, float] | None = None  # (when the last copy began, how long it took)
        self._before: float | None = None  # the cost of the copy before the last

    def due(self, now: float, replication_s: float | None) -> bool:
        """`replication_s`: how long the last copy's replication took; None while it is under way."""
        if self._last is None:
            return True
        if replication_s is None:
            return False
        began, copy_s = self._last
        cost = copy_s + replication_s if self._before is None else min(self._before, copy_s + replication_s)
        return now - began >= cost / self._budget

    def copied(self, began: float, copy_s: float, replication_s: float | None) -> None:
        """A copy began at `began` and took `copy_s` on the loop's thread; `replication_s`: how long the
        previous copy's replication took."""
        if self._last is not None and replication_s is not None:
            self._before = self._last[1] + replication_s
        self._last = (began, copy_s)



class ShareCopies:
    """A generation loop's copies of its sharded kept state: agreed at each report, then made."""

    def __init__(self, budget: float, host: WorkerServices):
        self._cadence = ShareCadence(budget)
        self._host = host

    def due(self, wanted: bool, index: int, generation: int) -> bool:
        """Does report `index` copy the share? Asked at every report by every rank, whatever it
        reports (the same collective everywhere): only where the cadence finds it due on every rank
        and none reports a checkpoint instead (`wanted` False). A copy never replaces one still on its
        way to a buddy."""
        try:
            due, delivered = every_rank(wanted and self._cadence.due(time.monotonic(), self._host.replication_s()),
                                        self._host.share_delivered())
        except RuntimeError as exc:
            raise PeerLost(f"report {index}'s agreement on copying the sharded state failed: {exc}") from exc
        if delivered:
            self._host.replicated(generation)
        return due

    def copy(self, snapshot: Callable[[], LivePart | None]) -> LivePart | None:
        """The share, copied now (`snapshot`), its cost noted for the cadence."""
        began = time.monotonic()
        part = snapshot()
        self._cadence.copied(began, time.monotonic() - began, self._host.replication_s())
        return part
