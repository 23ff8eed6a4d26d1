"""The `elastic-train` CLI, run as a user runs it (its own process) against real runs: one that
finished after losing a worker, and one still going."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from elastic_train.cli import app

from tests.conftest import ROOT
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import read_progress

CLI = str(Path(sys.executable).parent / "elastic-train")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`elastic-train ARGS` in a process of its own, as a user runs it."""
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})


def in_process(*args: str) -> subprocess.CompletedProcess:
    """`elastic-train ARGS` run by typer's test runner in this process: the same commands, without a
    new interpreter importing torch and Ray each time (for the commands that read storage only)."""
    outcome = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    if outcome.exception is not None and not isinstance(outcome.exception, SystemExit):
        raise outcome.exception
    return subprocess.CompletedProcess(args, outcome.exit_code, outcome.stdout, "")


def rows(stdout: str) -> list[list[str]]:
    """The cells of each data row of a table rich printed."""
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in stdout.splitlines() if "│" in line]


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.mark.timeout(180)
def test_commands_on_a_finished_run_that_lost_a_worker(local_ray, run_dirs, tmp_path):
    result = make_trainer(run_dirs, 2, steps=30, step_time=0.05, fault={"kind": "kill", "at_step": 5, "rank": 1}).fit()

    listed = cli("runs", run_dirs["storage"])  # its own process, as a user runs it
    assert listed.returncode == 0, listed.stderr
    (row,) = rows(listed.stdout)
    assert row[:2] == ["run", "finished"] and row[3] == "30", listed.stdout
    assert row[4] == " ".join(map(str, result.world_sizes)) and len(result.world_sizes) >= 2, listed.stdout
    assert row[5] == str(len(result.best_checkpoints)), listed.stdout

    events = in_process("events", result.path)
    assert events.returncode == 0, events.stderr
    kinds = [line.split()[1] for line in events.stdout.splitlines()]
    assert kinds == [e["kind"] for e in result.events] and "worker_lost" in kinds

    checkpoints = in_process("checkpoints", result.path, "--verify")
    assert checkpoints.returncode == 0, checkpoints.stderr
    table = rows(checkpoints.stdout)
    assert [r[1] for r in table] == [str(c.manifest.step) for c, _ in result.best_checkpoints]
    assert [r[-1] for r in table] == ["whole"] * len(table)
    # A damaged file is named, and the command says so with its exit code.
    newest = Path(result.best_checkpoints[-1][0].path)
    part = next(p for p in newest.iterdir() if p.name != "elastic_train_manifest.json")
    part.write_bytes(b"damaged")
    damaged = in_process("checkpoints", result.path, "--verify")
    assert damaged.returncode == 2 and part.name in damaged.stdout

    picture = tmp_path / "timeline.png"
    drawn = in_process("timeline", result.path, "-o", str(picture))
    assert drawn.returncode == 0, drawn.stderr
    assert png_size(picture) == (1200, 600)

    missing = in_process("events", str(tmp_path / "nowhere" / "run"))
    assert missing.returncode == 1 and "no event log at" in missing.stdout
    no_runs = in_process("runs", str(tmp_path / "empty"))
    assert no_runs.returncode == 1 and "no runs under" in no_runs.stdout


@pytest.mark.timeout(180)
def test_status_and_events_follow_on_a_live_run_from_another_process(local_ray, run_dirs):
    join = fit_in_background(make_trainer(run_dirs, 2, steps=80, step_time=0.1))
    wait_for(lambda: len({p["rank"] for p in read_progress(run_dirs["log_dir"])}) == 2, 60, "both ranks training")
    address = ray.get_runtime_context().gcs_address
    follow = subprocess.Popen([CLI, "events", str(Path(run_dirs["storage"], "run")), "--follow", "--interval", "0.2"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    status = cli("status", "run", "--address", address)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "run: running, generation" in lines[0] and "world size 2" in lines[0], status.stdout
    workers = rows(status.stdout)
    assert [w[0] for w in workers] == ["0", "1"], status.stdout
    assert all(float(w[5].split()[0]) < 5 and w[9] == "-" for w in workers), status.stdout  # heartbeats fresh
    # Datagrams carry the heartbeats; a Ray call is each worker's first (and a fallback, rarely needed here).
    udp, calls = map(int, re.fullmatch(r"heartbeats received: (\d+) as datagrams, (\d+) as Ray calls", lines[-1]).groups())
    assert calls >= 2 and udp > calls, lines[-1]
    result = join(150)
    out, _ = follow.communicate(timeout=60)  # --follow returns once the run ended
    assert follow.returncode == 0 and [line.split()[1] for line in out.splitlines()][-1] == "run_ended"
    assert len(out.splitlines()) == len(result.events)
    unknown = cli("status", "no-such-run", "--address", address)
    assert unknown.returncode == 1 and "no live run named 'no-such-run'" in unknown.stdout
