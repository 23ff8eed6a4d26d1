"""Which reported checkpoints go to storage: the store cadence.

By default every reported checkpoint is stored, in order (Ray Train's contract: users pick their
best epoch among them). A cadence (`store_every_n_reports`, `store_interval_s`) is what a user
opts into to store fewer: then, unless checkpoints are kept by score, a chosen checkpoint still
waiting for its upload is replaced by a newer one, so the newest state goes next instead of a queue
of stale ones. Checkpoints kept by score are all stored that are chosen: skipping one could lose the
best.

Why a decision in the supervisor: every rank reports its part of a checkpoint, and a checkpoint
commits only when all parts are stored. If each worker chose by itself, slow storage would leave
their uploads on different checkpoints and none would commit. The first report of a checkpoint
decides for all ranks. A dict checkpoint held live is the exception: its ranks decide, alike, at
the report's barrier (`CheckpointConfig.store_due`).
"""

from __future__ import annotations

from elastic_train.config import CheckpointConfig


class StoreCadence:
    def __init__(self, config: CheckpointConfig, now: float):
        self._config = config
        self._reports_since = 0
        self._last_chosen = now
        self._in_flight: int | None = None  # the chosen checkpoint not yet committed or given up

    @property
    def replaceable(self) -> bool:
        """May a newer checkpoint replace a chosen one still waiting for its upload?"""
        return self._config.replaceable

    def choose(self, index: int, now: float) -> bool:
        """Is reported checkpoint `index` to be stored?"""
        if self._config.stores_every:
            return True
        self._reports_since += 1
        if not self._config.store_due(self._reports_since, now - self._last_chosen) or (
                self.replaceable and self._in_flight is not None):
            return False
        self._reports_since, self._last_chosen = 0, now
        if self.replaceable:
            self._in_flight = index
        return True

    def settled(self, index: int) -> None:
        """Checkpoint `index` committed or was given up: the next one may be chosen."""
        if self._in_flight == index:
            self._in_flight = None

    def forget_in_flight(self) -> None:
        """A new generation: a part of the chosen checkpoint may have died with a lost worker."""
        self._in_flight = None
