"""Preemption notices: a worker learns that its machine is about to be taken away.

Why: a spot machine is not lost without warning. AWS posts `spot/instance-action` two minutes
ahead, GCP flips `instance/preempted` thirty seconds ahead, Azure schedules a `Preempt` event, and
a node being shut down (Kubernetes, systemd, a spot agent) sends SIGTERM. With that much notice
nothing needs to be lost: the worker tells the supervisor, which has the group unwind at the next
report and re-forms it without that worker, while the worker still serves its checkpoint from
memory. Without notice handling, the same event costs a crash and a redone step.

`NoticeWatcher` installs a SIGTERM handler (the actor's constructor runs on the process's main
thread, where Python allows it) and polls the configured cloud metadata endpoints on a thread of
its own. The first notice is reported once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)

_HTTP_TIMEOUT_S = 2.0


class NoticePoller(Protocol):
    name: str

    def check(self) -> float | None:
        """Seconds until the machine goes (0 if unknown but imminent), or None when no notice is posted."""


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def _seconds_until(timestamp: str) -> float:
    when = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    if when.tzinfo is None:  # Azure's NotBefore is an RFC 1123 date; ISO forms are handled here
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


class AwsSpotPoller:
    """AWS IMDSv2: a session token, then `spot/instance-action` (404 until a notice is posted)."""

    name = "aws"

    def __init__(self, base_url: str = "http://169.254.169.254"):
        self.base_url = base_url.rstrip("/")

    def check(self) -> float | None:
        status, token = _get(f"{self.base_url}/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        if status != 200:
            return None
        status, body = _get(f"{self.base_url}/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": token.decode()})
        if status != 200:
            return None
        notice = json.loads(body)
        return _seconds_until(notice["time"]) if notice.get("action") in ("terminate", "stop", "hibernate") else None


class GcpPreemptedPoller:
    """GCP: `instance/preempted` reads TRUE once the VM is being preempted (about 30 s ahead)."""

    name = "gcp"

    def __init__(self, base_url: str = "http://metadata.google.internal"):
        self.base_url = base_url.rstrip("/")

    def check(self) -> float | None:
        status, body = _get(f"{self.base_url}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        return 30.0 if status == 200 and body.strip().upper() == b"TRUE" else None


class AzureScheduledEventsPoller:
    """Azure: a `Preempt` event among the Scheduled Events."""

    name = "azure"

    def __init__(self, base_url: str = "http://169.254.169.254"):
        self.base_url = base_url.rstrip("/")

    def check(self) -> float | None:
        status, body = _get(f"{self.base_url}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        if status != 200:
            return None
        for event in json.loads(body).get("Events", []):
            if event.get("EventType") == "Preempt":
                not_before = event.get("NotBefore") or ""
                try:
                    return _seconds_until(not_before) if not_before else 0.0
                except ValueError:
                    return 30.0  # RFC 1123 dates: Azure gives at least 30 s
        return None


POLLERS: dict[str, type] = {"aws": AwsSpotPoller, "gcp": GcpPreemptedPoller, "azure": AzureScheduledEventsPoller}


def make_pollers(names: tuple[str, ...], base_url: str | None) -> list[NoticePoller]:
    return [POLLERS[n](base_url) if base_url else POLLERS[n]() for n in names]


class NoticeWatcher:
    """Calls `on_notice(source, seconds_left)` once, at the first notice from SIGTERM or a poller."""

    def __init__(self, on_notice: Callable[[str, float | None], None], pollers: list[NoticePoller],
                 poll_interval_s: float, handle_sigterm: bool, sigterm_grace_s: float):
        self._on_notice = on_notice
        self._pollers = pollers
        self._interval = poll_interval_s
        self._grace = sigterm_grace_s
        self._noticed = threading.Event()
        self._stopped = threading.Event()
        self._sigterm_seen = False
        self._previous_sigterm: Any = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread = threading.Thread(target=self._poll, name="elastic-preemption", daemon=True)
        if pollers:
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The first SIGTERM is a notice: leave at the next report, and exit as SIGTERM asks `sigterm_grace_s` later (or
        at a second SIGTERM), through the handler that was there before."""
        if self._sigterm_seen:
            self._exit_as_before(signum, frame)
            return
        self._sigterm_seen = True
        # A signal handler must return quickly: the notice is sent from a thread.
        threading.Thread(target=self._notify, args=("sigterm", None), daemon=True).start()
        timer = threading.Timer(self._grace, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    def _exit_as_before(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _poll(self) -> None:
        while not self._stopped.wait(self._interval) and not self._noticed.is_set():
            for poller in self._pollers:
                try:
                    seconds_left = poller.check()
                except (OSError, ValueError) as exc:
                    logger.debug("preemption poller %s: %s", poller.name, exc)
                    continue
                if seconds_left is not None:
                    self._notify(poller.name, seconds_left)
                    return

    def _notify(self, source: str, seconds_left: float | None) -> None:
        if self._noticed.is_set():
            return
        self._noticed.set()
        logger.warning("preemption notice from %s (%s s left): leaving this worker", source,
                       "?" if seconds_left is None else f"{seconds_left:.0f}")
        self._on_notice(source, seconds_left)
