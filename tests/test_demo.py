"""What `make demo` prints: Ray's notice of a worker death is left out for the process the demo
killed itself (its own chaos line says it), and only for that one."""

from __future__ import annotations

import io

import pytest

from elastic_train.demo import OwnKillsQuiet

NOTICE = ("\x1b[33m(raylet)\x1b[0m A worker died or was killed while executing a task by an unexpected system "
          "error. Worker IP address: 192.0.2.2 Worker port: 42925 Worker PID: {pid} Worker exit type: SYSTEM_ERROR")


@pytest.mark.timeout(10)
def test_the_notice_of_a_process_the_demo_killed_is_left_out_with_its_line_end():
    out = io.StringIO()
    quiet = OwnKillsQuiet(out)
    quiet.killed.add(15755)
    for text in ("before\n", NOTICE.format(pid=15755), "\n", NOTICE.format(pid=1575), "\n", "after", "\n"):
        assert quiet.write(text) == len(text)
    # Another process's death (a PID that merely starts alike) and every other line go through.
    assert out.getvalue() == "before\n" + NOTICE.format(pid=1575) + "\nafter\n"
    assert quiet.getvalue() == out.getvalue()  # the rest of the stream's interface is the stream's
