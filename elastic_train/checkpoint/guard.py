"""Within one process, a checkpoint folder being committed is never removed, and one being removed
is never committed.

Why: the supervisor commits checkpoints while it also removes folders (beyond retention, torn,
corrupt); a removal under a commit would leave a manifest over missing files.
The guard is the process's own: a pickled copy starts empty, as what a process is committing or
removing is known to that process only.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from elastic_train.checkpoint.layout import Attempt


class CommitGuard:
    """The attempts this process is committing (a commit may be marked more than once) or removing."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._committing: collections.Counter[Attempt] = collections.Counter()
        self._removing: set[Attempt] = set()

    def __reduce__(self) -> tuple[Callable[[], "CommitGuard"], tuple[Any, ...]]:
        return CommitGuard, ()

    def begin_commit(self, attempt: Attempt) -> bool:
        """Mark `attempt` as being committed; False (and nothing marked) if it is being removed."""
        with self._condition:
            if attempt in self._removing:
                return False
            self._committing[attempt] += 1
            return True

    def end_commit(self, attempt: Attempt) -> None:
        """One commit of `attempt` that `begin_commit` marked is over (done or not)."""
        with self._condition:
            self._committing[attempt] -= 1
            if self._committing[attempt] <= 0:
                del self._committing[attempt]
            self._condition.notify_all()

    def begin_removal(self, attempt: Attempt) -> bool:
        """Claim `attempt` for removal; False (and nothing claimed) if it is being committed or removed."""
        with self._condition:
            if self._committing.get(attempt) or attempt in self._removing:
                return False
            self._removing.add(attempt)
            return True

    def end_removal(self, attempt: Attempt) -> None:
        with self._condition:
            self._removing.discard(attempt)

    def wait_for_commits(self, timeout_s: float) -> bool:
        """Wait until no commit is under way; False if `timeout_s` passed first."""
        with self._condition:
            return self._condition.wait_for(lambda: not self._committing, timeout=timeout_s)
