"""`elastic-train`: look at runs from a terminal, while they run and after.

    elastic-train runs STORAGE                     runs under a storage_path: state, steps, world sizes
    elastic-train events RUN_PATH [--follow]       the run's event log, as it grows
    elastic-train checkpoints RUN_PATH [--verify]  committed checkpoints (and whether their files are whole)
    elastic-train timeline RUN_PATH -o out.png     step rate, world size, faults and commits over time
    elastic-train status NAME [--address auto]     the live run on the Ray cluster, worker by worker
    elastic-train check PATH [--all]               the reads of its place that make a loop re-enter, not go on in place

RUN_PATH is a run's folder as `Result.path` gives it, STORAGE a `storage_path`: a local folder or
any fsspec URL; `-O key=value` passes storage options (credentials usually come from the
environment, as for the run). All but `status` and `check` read the run's folder only: JSON and
manifests; `check` reads a training script's source (without running it).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from elastic_train.checkpoint.filesystems import open_filesystem
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.errors import ConfigError
from elastic_train.events import RunEnded
from elastic_train.faithful.check import check_source
from elastic_train.faithful.sites import LOGGED
from elastic_train.progress import event_details, format_metrics
from elastic_train.result import Result
from elastic_train.run_folder.event_log import EVENT_LOG, read_events
from elastic_train.run_folder.record import RUN, read_json

app = typer.Typer(help=__doc__.split("\n\n")[0], no_args_is_help=True, add_completion=False)


def _console() -> Console:
    """Made per command: its width follows the terminal (or $COLUMNS) of this call."""
    return Console()

Options = typer.Option([], "--storage-option", "-O", help="a storage option, key=value (value read as JSON if it parses)")


def _options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: write key=value, e.g. -O endpoint_url=http://127.0.0.1:9000")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _result(run_path: str, options: dict[str, Any]) -> Result:
    try:
        return Result.from_path(run_path, storage_options=options)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def _when(seconds: float | None) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S") if seconds else "-"


@app.command()
def runs(storage: str = typer.Argument(..., help="a storage_path"), storage_option: list[str] = Options) -> None:
    """The runs stored under STORAGE."""
    console = _console()
    options = _options(storage_option)
    fs, root = open_filesystem(storage, options)
    table = Table("run", "state", "started", "last step", "world sizes", "checkpoints", "newest checkpoint")
    found = 0
    try:
        entries = sorted(fs.ls(root, detail=False))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        run = RunStorage(storage, name, options)
        record = read_json(run, RUN, None)
        if record is None:
            continue
        found += 1
        result = _result(run.url(), options)
        last = result.metrics_history[-1]["_index"] if result.metrics_history else "-"
        sizes = result.world_sizes
        newest = result.best_checkpoints[-1][0].manifest.step if result.best_checkpoints else "-"
        table.add_row(name, str(record.get("state", "?")).lower(), _when(record.get("started")), str(last),
                      " ".join(map(str, sizes)) or "-", str(len(result.best_checkpoints)), f"step {newest}")
    if not found:
        console.print(f"no runs under {storage}")
        raise typer.Exit(1)
    console.print(table)


def _event_line(event: dict[str, Any], start: float) -> str:
    return f"{event.get('time', start) - start:9.2f}s  {event['kind']:<26} {event_details(event)}"


@app.command()
def events(run_path: str = typer.Argument(..., help="a run's folder (Result.path)"),
           follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new events until the run ends"),
           interval: float = typer.Option(1.0, help="seconds between reads with --follow"),
           storage_option: list[str] = Options) -> None:
    """The run's events, oldest first."""
    console = _console()
    storage = RunStorage.at(run_path, _options(storage_option))
    if storage.read(EVENT_LOG) is None and not follow:
        console.print(f"no event log at {storage.url(EVENT_LOG)}")
        raise typer.Exit(1)
    shown, start = 0, None
    while True:
        entries = read_events(storage)
        if start is None and entries:
            start = entries[0].get("time", 0.0)
        for event in entries[shown:]:
            console.print(_event_line(event, start), markup=False, highlight=False, soft_wrap=True)
        shown = max(shown, len(entries))
        if not follow or any(RunEnded.of(e) for e in entries):
            return
        time.sleep(interval)


@app.command()
def checkpoints(run_path: str = typer.Argument(..., help="a run's folder (Result.path)"),
                verify: bool = typer.Option(False, "--verify", help="read every file and check its size and checksum"),
                storage_option: list[str] = Options) -> None:
    """The run's committed checkpoints, oldest first."""
    console = _console()
    storage = RunStorage.at(run_path, _options(storage_option))
    committed = storage.committed()
    columns = ["folder", "step", "generation", "world size", "files", "MB", "created", "metrics"]
    table = Table(*columns, *(["verified"] if verify else []))
    bad = 0
    for checkpoint in committed:
        manifest = checkpoint.manifest
        row = [checkpoint.path.rstrip("/").rsplit("/", 1)[-1], str(manifest.step), str(manifest.generation),
               str(manifest.world_size), str(len(manifest.files)), f"{manifest.total_bytes / 2**20:.2f}",
               _when(manifest.created), json.dumps(manifest.metrics, default=str)[:60]]
        if verify:
            problems = [p.removeprefix(f"{checkpoint.path}/") for p in storage.verify(checkpoint)]
            bad += bool(problems)
            row.append("whole" if not problems else "; ".join(problems))
        table.add_row(*row)
    console.print(table if committed else f"no committed checkpoint in {run_path}")
    if bad:
        raise typer.Exit(2)


@app.command()
def status(name: str = typer.Argument(..., help="the run's name (RunConfig.name)"),
           address: str = typer.Option("auto", help="the Ray cluster's address, as for ray.init")) -> None:
    """Attach to the live run NAME on the Ray cluster: its state, and every worker's place, heartbeat,
    step time, memory and flags."""
    console = _console()
    import ray

    from elastic_train.driver.launch import attach

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        try:
            supervisor = attach(name)
        except ValueError:
            console.print(f"no live run named {name!r} on the cluster at {address}")
            raise typer.Exit(1) from None
        snapshot = ray.get(supervisor.status.remote(0), timeout=30)
    finally:
        ray.shutdown()
    metrics = format_metrics(snapshot["metrics"])
    console.print(f"[bold]{name}[/]: {snapshot['state'].lower()}, generation {snapshot['generation']}, "
                  f"world size {snapshot['world_size']}, report {snapshot['index']}  {metrics}")
    table = Table("rank", "worker", "node", "ip", "pid", "heartbeat age", "step time", "RSS MB", "CPU %", "flags")
    for worker_id, member in sorted(snapshot["members"].items(), key=lambda item: item[1]["rank"]):
        flags = [flag for flag in ("straggler", "memory_growing") if member.get(flag)]
        step = member.get("step_s")
        table.add_row(str(member["rank"]), str(worker_id), member["node"][:12], member["ip"], str(member["pid"]),
                      f"{member['heartbeat_age_s']:.1f} s", f"{step:.3f} s" if step is not None else "-",
                      f"{member.get('rss_bytes', 0) / 2**20:.0f}", f"{member.get('cpu_percent', 0):.0f}",
                      " ".join(flags) or "-")
    console.print(table)
    beats = snapshot["heartbeats"]
    console.print(f"heartbeats received: {beats['udp']} as datagrams, {beats['ray']} as Ray calls")


@app.command()
def timeline(run_path: str = typer.Argument(..., help="a run's folder (Result.path)"),
             output: Path = typer.Option(..., "--output", "-o", help="the PNG to write"),
             storage_option: list[str] = Options) -> None:
    """Draw the run: steps per second and world size over time, with its faults and commits."""
    console = _console()
    from elastic_train.timeline import draw

    result = _result(run_path, _options(storage_option))
    draw(result, output)
    console.print(f"wrote {output}")


@app.command()
def check(script: Path = typer.Argument(..., metavar="PATH", help="a training script, read without running it"),
          all_reads: bool = typer.Option(False, "--all", help="list the logged reads too (they never matter)")) -> None:
    """The reads of its place (rank, world size...) in PATH's loops that make it re-enter after a
    recovery rather than go on in place, and how to write them so it goes on."""
    console = _console()
    if not script.is_file():
        raise typer.BadParameter(f"{script}: {'a folder, not a file' if script.is_dir() else 'no such file'}")
    try:
        findings = check_source(script.read_text(encoding="utf-8"), str(script))
    except UnicodeDecodeError:
        raise typer.BadParameter(f"{script}: not Python (not UTF-8 text)") from None
    except OSError as exc:
        raise typer.BadParameter(f"{script}: {exc.strerror or exc}") from None
    except (SyntaxError, ValueError) as exc:
        why = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, SyntaxError) else str(exc)
        raise typer.BadParameter(f"{script}: not Python ({why})") from None
    shown = [f for f in findings if all_reads or f.use != LOGGED]
    if shown:
        table = Table("line", "what", "use", "code", "advice")
        for finding in shown:  # Text: code such as `buf[rank]` is not rich markup
            table.add_row(str(finding.line), finding.what, finding.use, Text(finding.text), Text(finding.advice))
        console.print(table)
    held = sum(f.held for f in findings)
    console.print("nothing held: the loop goes on in place after a recovery" if not held else
                  f"{held} read{' holds its' if held == 1 else 's hold their'} place: "
                  f"the loop re-enters after a recovery that changes {'it' if held == 1 else 'them'}",
                  markup=False, highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
