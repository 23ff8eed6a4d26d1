"""A run drawn over time: how fast it trained, at what world size, when it lost workers, was
preempted, had a straggler, and committed checkpoints. Read from its folder (`Result.from_path`),
so it works for a run still going and for one whose driver died.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastic_train.errors import ConfigError
from elastic_train.events import LOST_KINDS, CheckpointCommitted, GenerationOpened
from elastic_train.result import Result

SIZE_PX = (1200, 600)  # the PNG's width and height
DPI = 100
RATE_WINDOW = 5  # reports averaged into one point of the step rate

MARKS = {  # event kind -> (colour, label): vertical lines across both panels
    "worker_lost": ("tab:red", "worker lost"),
    "preemption_notice": ("tab:orange", "preemption notice"),
    "straggler": ("tab:purple", "straggler"),
    "memory_growing": ("tab:brown", "memory growing"),
    "supervisor_restarted": ("black", "supervisor restarted"),
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("drawing a timeline needs matplotlib: pip install 'elastic_train[timeline]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_rate(times: list[float], window: int = RATE_WINDOW) -> tuple[list[float], list[float]]:
    """Reports per second over the last `window` reports, at each report's time."""
    points = [(t, window / (t - times[i - window])) for i, t in enumerate(times)
              if i >= window and t > times[i - window]]
    return [t for t, _ in points], [r for _, r in points]


def world_over_time(events: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """The world size at each change: a generation's as it opens, less each of its members lost or
    gone since, until the next one opens (a fixed-size run waiting for a replacement is drawn with its
    survivors, not the size it had)."""
    times, sizes = [], []
    generation, size, gone = None, 0, set()
    for event in events:
        opened = GenerationOpened.of(event)
        if opened is not None:
            generation, size, gone = opened.generation, opened.world_size, set()
        elif (event["kind"] in LOST_KINDS and generation is not None and event.get("generation") == generation
              and event.get("rank", -1) >= 0 and event.get("worker_id") not in gone):
            gone.add(event.get("worker_id"))  # lost as it left under a notice: told twice, counted once
            size = max(0, size - 1)
        else:
            continue
        times.append(event["time"])
        sizes.append(size)
    return times, sizes


def draw(result: Result, output: str | Path) -> Path:
    """Write the run's timeline to the PNG `output`."""
    plt = _pyplot()
    events = result.events
    times = [h["_time"] for h in result.metrics_history if h.get("_time")]
    start = min([e["time"] for e in events if "time" in e] + times, default=0.0)
    figure, (rate, world) = plt.subplots(2, 1, sharex=True, figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI,
                                         gridspec_kw={"height_ratios": [3, 2]})
    at, per_s = step_rate(times)
    rate.plot([t - start for t in at], per_s, color="tab:blue", linewidth=1.2)
    rate.set_ylabel("steps / s")
    rate.set_title(f"{Path(result.path).name}: {len(result.metrics_history)} reports, "
                   f"{len(result.best_checkpoints)} checkpoints kept")
    changed, ys = world_over_time(events)
    if changed:
        end = max([e["time"] for e in events if "time" in e] + times)
        world.step([t - start for t in changed] + [end - start], ys + ys[-1:], where="post", color="tab:green")
        world.set_ylim(0, max(ys) + 1)
    world.set_ylabel("world size")
    world.set_xlabel("seconds since the run started")
    commits = [e["time"] - start for e in events if CheckpointCommitted.of(e)]
    world.plot(commits, [0.15] * len(commits), "|", color="tab:gray", markersize=8, label="checkpoint committed")
    labelled = set()
    for event in events:
        if event["kind"] in MARKS:
            colour, label = MARKS[event["kind"]]
            for axis in (rate, world):
                axis.axvline(event["time"] - start, color=colour, linestyle="--", linewidth=1,
                             label=None if label in labelled or axis is rate else label)
            labelled.add(label)
    world.legend(loc="upper right", fontsize="small")
    for axis in (rate, world):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    output = Path(output)
    figure.savefig(output, dpi=DPI)
    plt.close(figure)
    return output
