"""Memory corruption: one byte of a checkpoint copy a worker holds, flipped, as failing memory (or a
bug that serves the wrong bytes) would leave it.

It runs inside the worker's own process (from its training loop, say): no other process can reach
that memory. What must follow: the copy is found corrupt where it is served (each file is checked
against the facts it was reported with), the `checkpoint_copy_corrupt` event says so, and the run
resumes from another copy, storage or an older checkpoint.
"""

from __future__ import annotations

import gc

from elastic_train.worker.hold.parts import HeldParts


def corrupt_held_copy(index: int, name: str) -> bool:
    """Flip one byte of file `name` of checkpoint `index` as this process holds it (its own part, or a
    peer's it keeps); False if it holds none."""
    for memory in (found for found in gc.get_objects() if isinstance(found, HeldParts)):
        with memory._lock:
            for key, (held, part) in memory._parts.items():
                if key[1] == index and isinstance(part, dict) and name in part:
                    data = bytearray(part[name])
                    data[len(data) // 2] ^= 0xFF
                    memory._parts[key] = (held, {**part, name: bytes(data)})
                    return True
    return False
