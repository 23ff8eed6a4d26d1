"""This worker process's resident memory, read at every report (supervisor/watch/pace.py watches it grow).

Why not `psutil.Process().memory_info()`: it opens, reads and closes `/proc/<pid>/statm` each time,
~0.2 ms on a loop woken from a step's compute, which is most of a 1 % budget for `report()` at a
50 ms step. On Linux the file is kept open and re-read in place (~0.05 ms); elsewhere psutil answers.
"""

from __future__ import annotations

import os
import threading

import psutil

_STATM = "/proc/self/statm"  # pages: size resident shared text lib data dirty
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_opened: tuple[int, int] | None = None  # (pid, fd): a forked child must open its own
_opening = threading.Lock()  # the loop and the heartbeat thread both read it


def resident_bytes() -> float:
    """The process's resident set size in bytes."""
    global _opened
    pid = os.getpid()
    if _opened is None or _opened[0] != pid:
        with _opening:
            if _opened is None or _opened[0] != pid:
                try:
                    _opened = (pid, os.open(_STATM, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)))
                except OSError:  # no procfs (macOS, Windows)
                    return float(psutil.Process(pid).memory_info().rss)
    return float(int(os.pread(_opened[1], 128, 0).split()[1]) * _PAGE_BYTES)
