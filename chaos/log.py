"""The record of every injected fault (time, kind, target, details), as JSON lines, so that a
run's timeline can be rebuilt next to its own events."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class FaultLog:
    """Appends one JSON line per fault to `path` (if given) and keeps them in `entries`."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self.entries: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(self, kind: str, target: Any, **details: Any) -> dict[str, Any]:
        entry = {"time": time.time(), "kind": kind, "target": target, **details}
        with self._lock:
            self.entries.append(entry)
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps(entry, default=str) + "\n")
        logger.warning("chaos: %s -> %s %s", kind, target, details or "")
        return entry
