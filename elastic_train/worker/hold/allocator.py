"""Keeps freed heap memory in the worker process, so that checkpoint snapshots reuse warm pages.

Why: `report(checkpoint=...)` copies the checkpoint's files into memory. glibc serves an allocation
of more than 128 KiB with a fresh `mmap` and returns it to the kernel on free, so every snapshot
faults in and zero-fills new pages: on a 2-core VM that made copying an 8 MB file take 5-6 ms instead
of 1 ms, most of a report's cost. Raising glibc's mmap threshold (to its 32 MiB ceiling) and its
trim threshold keeps those pages in the heap for the next snapshot. The cost is that the worker's
resident memory does not shrink after its peak, by up to the retained amount.
Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_CEILING = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)


def retain_freed_memory(retain_mb: int) -> bool:
    """Ask glibc to keep up to `retain_mb` MiB of freed heap memory; False where that is not possible."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.debug("no glibc mallopt here; the allocator keeps its defaults")
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, min(_MMAP_THRESHOLD_CEILING, retain_mb * 2**20)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, retain_mb * 2**20) == 1 and ok
    if not ok:
        logger.warning("mallopt refused to retain %d MiB of freed memory; checkpoint snapshots will be slower", retain_mb)
    return ok
