"""What `fit()` shows while the run goes (`ElasticConfig(verbosity=...)`): a live status line (step, the
metrics rank 0 reported, world size, generation, newest committed checkpoint, time elapsed) and a
line per event that changes the run (a worker lost or joined, a resize, a notice, a straggler).

On a terminal the status line stays at the bottom and is redrawn in place (rich's `Live`); when
stdout is not a terminal (a log file, CI) the status is a plain line every
`ElasticConfig.progress_interval_s`. verbosity 0 shows nothing, 1 the above, 2 also every commit and
every other event, and a line per report.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

from rich.console import Console
from rich.live import Live
from rich.text import Text

from elastic_train.events import GenerationOpened
from elastic_train.protocol import Feed

logger = logging.getLogger(__name__)

SHOWN = {  # event kind -> how verbosity 1 shows it; other kinds at verbosity 2
    "generation": lambda e: (f"generation {e['generation']}: world size {e['world_size']}, "
                             + ("adopted by the restarted supervisor" if e.get("adopted") else
                                f"the loops went on in place after report {e['resume_index']}"
                                if e.get("resume_from") == "in place" else
                                (f"resumed from {e['resume_from']} at report {e['resume_index']}"
                                 if e.get("resume_from") else "from the start")
                                + (f" (re-entered: {e['reentered_because']})" if e.get("reentered_because") else ""))),
    "worker_lost": lambda e: (f"{'warm spare' if e.get('spare') else 'worker'} {e['worker_id']} (rank {e['rank']}, "
                              f"pid {e['pid']}) lost, "
                              f"{e.get('cause', '?')}: {e['reason']}"),
    "worker_left": lambda e: f"worker {e['worker_id']} (rank {e['rank']}, pid {e['pid']}) left: {e['cause']}",
    "resize_requested": lambda e: f"resizing after report {e['at_report']}: {e['reason']}",
    "preemption_notice": lambda e: f"preemption notice ({e.get('source')}) for worker {e.get('worker_id')}",
    "straggler": lambda e: (f"rank {e['rank']} is a straggler: {e['step_s']:.3f} s a step against its peers' median "
                            f"{e['median_step_s']:.3f} s"),
    "straggler_cleared": lambda e: f"worker {e['worker_id']} caught up",
    "memory_growing": lambda e: f"rank {e['rank']}'s memory keeps growing: {e['rss_mb']} MB",
    "failure": lambda e: (f"failure {e['count']} (max_failures={e['max_failures']}): "
                          + (e.get("detail") or "").strip().rpartition("\n")[2]),
    "supervisor_restarted": lambda e: "the supervisor was restarted; it adopted the workers",
    "run_ended": lambda e: f"run ended: {e['state'].lower()}",
}


def format_metrics(metrics: dict[str, Any]) -> str:
    """Reported metrics on one line: scalars only, floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
                    if isinstance(v, (int, float, str)) and not k.startswith("_"))


def event_details(event: dict[str, Any]) -> str:
    """An event's fields but its kind and times, on one line."""
    return " ".join(f"{k}={v}" for k, v in event.items() if k not in ("t", "time", "kind"))


class Progress:
    """Shows a run's feed; `close()` when `fit()` ends."""

    def __init__(self, name: str, verbosity: int, interval_s: float, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._name, self._verbosity, self._interval_s, self._clock = name, verbosity, interval_s, clock
        self._console = console or Console()
        self._started = self._last_plain = clock()
        self._index, self._metrics, self._world, self._generation, self._committed = 0, {}, 0, -1, None
        self._live = (Live(self._status(), console=self._console, auto_refresh=False, transient=False)
                      if verbosity and self._console.is_terminal else None)
        if self._live is not None:
            self._live.start()

    def update(self, feed: Feed) -> None:
        """Show what `feed` brings; a display that fails (a closed stdout, an event of an unknown
        shape) is turned off with a warning: it must never stop the run."""
        if not self._verbosity:
            return
        try:
            self._show(feed)
        except Exception as exc:  # noqa: BLE001 - see above
            logger.warning("the run's progress display is off: %r", exc)
            live, self._live, self._verbosity = self._live, None, 0
            if live is not None:
                with contextlib.suppress(Exception):
                    live.stop()

    def _show(self, feed: Feed) -> None:
        for report in feed.reports:
            self._index = report.index
            self._metrics = report.metrics[0] if report.metrics else {}
            if report.checkpoint is not None:
                self._committed = report.checkpoint.index
            if self._verbosity >= 2:
                self._line(f"report {report.index}: {format_metrics(self._metrics)}")
        for event in feed.events:
            opened = GenerationOpened.of(event)
            if opened is not None:
                self._world, self._generation = opened.world_size, opened.generation
            shown = SHOWN.get(event["kind"])
            if shown is not None:
                self._line(shown(event))
            elif self._verbosity >= 2:
                self._line(f"{event['kind']}: {event_details(event)}")
        if self._live is not None:
            self._live.update(self._status(), refresh=True)
        elif self._clock() - self._last_plain >= self._interval_s:
            self._last_plain = self._clock()
            self._console.print(self._status(), highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        elif self._verbosity:
            self._console.print(self._status(), highlight=False, soft_wrap=True)

    def _line(self, text: str) -> None:
        self._console.print(Text(f"[{self._name}] {text}"), highlight=False, soft_wrap=True)

    def _status(self) -> Text:
        elapsed = int(self._clock() - self._started)
        committed = f"checkpoint {self._committed}" if self._committed is not None else "no checkpoint yet"
        return Text(f"[{self._name}] report {self._index} | {format_metrics(self._metrics) or '-'} | world size "
                    f"{self._world} | generation {self._generation} | {committed} | "
                    f"{elapsed // 60:02d}:{elapsed % 60:02d}")
