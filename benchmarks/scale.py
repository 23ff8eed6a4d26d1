"""The supervisor's control plane at scale: failure-detection latency and supervisor CPU against N workers.

Why: every worker heartbeats the one supervisor actor every `heartbeat_interval_s`, and the control
loop scans every worker record each `control_tick_s` to drop the silent ones. Both grow with N: this
measures how far, so the timeouts can be chosen knowing what a large run costs, and so the point
where the supervisor stops keeping up is a number rather than a guess. Both transports are measured
side by side: UDP datagrams (the default, `supervisor/heartbeats.py`) and Ray actor calls (the
bootstrap and fallback, and `heartbeat_udp=False`).

What: the supervisor's real detection parts in a Ray async actor created as `trainer.py` creates the
supervisor (0 CPUs, max_concurrency=10,000): `ScaleSupervisor` composes its `Roster` with N simulated
members (generation 0, running) and its `Heartbeats` intake, and runs the detection part of the
control loop: a wait for a wake-up or `control_tick_s`, then `Roster.drop_silent`. Heartbeats take
the real paths into it: datagrams to its endpoint, or calls of `heartbeat` over Ray. A few `HeartbeatSender` actors simulate the workers, one coroutine
per worker doing what `worker/heartbeat.py` does, each from a random phase. Over UDP: a datagram
every `heartbeat_interval_s`, whatever came back; a reply later than `heartbeat_reply_timeout_s`
counts as a timeout (a real worker would then make a Ray call). Over Ray: wait
`heartbeat_interval_s`, call `heartbeat`, wait for the reply at most 4 intervals at a time, and send
the next only once it is answered (one heartbeat in flight per worker). Per N and transport, on a
fresh supervisor and senders:

1. warm-up, then a steady-state window: the supervisor's CPU (psutil, on its PID; 100 % = one
   core), the senders' and the whole machine's; heartbeats the supervisor served per second against
   the target N / interval, and its CPU per heartbeat; the round trip of the heartbeats the senders
   had answered in time, and how many timed out; the cost of one `Roster.drop_silent` scan
   (`scan_ms`) and the gap between ticks (event-loop lag shows there);
2. failures: a random set of workers (staggered over a few seconds) stop heartbeating. Per failure,
   `detect_delay_s` = the `worker_lost` event's time - the worker's last heartbeat's send time -
   `heartbeat_timeout_s` (the delay beyond the timeout: the tick phase, plus how long the last
   heartbeat queued), and `silent_to_lost_s` (the same without subtracting the timeout).
   p99 of ~20 failures is close to their maximum. `false_losses` counts workers declared lost
   that were still heartbeating (the supervisor fell more than the timeout behind).

Senders and supervisor share this machine's cores: on a real cluster the senders are on other
machines. Where the heartbeats served per second fall below 90 % of the target, the machine could
not sustain that N (the output says so); the figures of that N are those of an overloaded control
plane.

The Ray transport is measured up to `--ray-max-workers` (1,000): past that this machine serves a
fraction of its heartbeats.

    python -m benchmarks.scale --out results/scale
    python -m benchmarks.scale --quick --out /tmp/bench_scale
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from benchmarks.common import machine_facts
from elastic_train.checkpoint.retry import RetryPolicy
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.config import CheckpointConfig, ElasticConfig, ScalingConfig
from elastic_train.protocol import Beat, BeatReply, HeartbeatChannel
from elastic_train.run_spec import LoopSpec, RunInfo, WorkerSpec
from elastic_train.supervisor.heartbeats import Heartbeats, widen_receive_buffer
from elastic_train.supervisor.membership import WorkerRecord, WorkerStatus
from elastic_train.supervisor.roster import Roster
from elastic_train.supervisor.state import RunState
from elastic_train.supervisor.tasks import Tasks
from elastic_train.supervisor.watch.telemetry import Telemetry

logger = logging.getLogger("benchmarks.scale")

ROOT = Path(__file__).resolve().parents[1]
FACTS = {"rss_bytes": 2.0e9, "cpu_percent": 100.0}  # what a worker's heartbeat carries (heartbeat.py)
START_DELAY_S = 1.0  # time for every sender to receive its plan before the first heartbeat
WARMUP_S = 3.0
STAGGER_S = 4.0  # the failures are spread over this long
DETECT_GRACE_S = 20.0  # how long past the timeout a failure may stay undetected before the run gives up on it


@dataclasses.dataclass
class _Running:
    """The run as the detection parts read it (state.RunView): generation 0 of N members, running."""

    state: RunState = RunState.RUNNING
    generation: int = 0
    world_size: int = 0
    flush_chosen: bool = False

    def is_member(self, w: WorkerRecord) -> bool:
        return w.generation == self.generation and w.rank >= 0


class _Entries:
    """Keeps the recorded events (an `EventObserver`)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def on_event(self, event: Any, entry: dict[str, Any], now: float) -> None:
        self.entries.append(entry)


class ScaleSupervisor:
    """The supervisor's detection parts, used alone: its roster with N simulated members and its
    heartbeat intake (both transports), scanned as the control loop scans them."""

    def __init__(self, spec: WorkerSpec, scaling: ScalingConfig) -> None:
        self._elastic = spec.elastic
        self._run = _Running(world_size=scaling.max_workers)
        self._events = _Entries()
        self._wake, serving = asyncio.Event(), asyncio.Event()
        telemetry = Telemetry([self._events], time.monotonic())
        self._roster = Roster(spec, scaling, "scale:", telemetry, Tasks(), self._wake)
        self._heartbeats = Heartbeats(self._run, self._elastic, self._roster, telemetry, serving)
        self._serving = serving
        self._detecting = False

    async def populate(self, n: int) -> tuple[int, HeartbeatChannel | None]:
        """Register workers 0..n-1 as members of generation 0 (as if they had heartbeated just now),
        serve calls and datagrams; returns this process's PID and the heartbeat channel."""
        now = time.monotonic()
        for i in range(n):
            self._roster.records[i] = WorkerRecord(i, actor=None, status=WorkerStatus.TRAINING, last_heartbeat=now,
                                                   generation=0, rank=i)
        self._detecting = True
        await self._heartbeats.open()
        self._serving.set()
        return os.getpid(), self._heartbeats.channel

    async def heartbeat(self, worker_id: int, generation: int | None, facts: dict[str, float]) -> Any:
        """`Supervisor.heartbeat`: the Ray path."""
        return self._heartbeats.by_call(self._roster.records.get(worker_id), worker_id, generation, facts)

    async def detect(self) -> list[tuple[float, float, int]]:
        """The control loop, detection only: wait for a wake-up or `control_tick_s`, then drop silent
        workers, until `stop_detecting`. Returns each tick's (wall time, seconds the scan took,
        heartbeats served so far)."""
        ticks: list[tuple[float, float, int]] = []
        while self._detecting:
            try:
                await asyncio.wait_for(self._wake.wait(), self._elastic.control_tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            wall, started = time.time(), time.perf_counter()
            self._roster.drop_silent(time.monotonic())
            ticks.append((wall, time.perf_counter() - started, sum(self._heartbeats.counts.values())))
        return ticks

    async def stop_detecting(self) -> None:
        self._detecting = False
        self._wake.set()
        self._heartbeats.close()

    async def events(self, since: int = 0) -> list[dict[str, Any]]:
        """The events from `since` on."""
        return self._events.entries[since:]


class HeartbeatSender:
    """Simulated workers: one coroutine per worker, the loop of `worker/heartbeat.py`. A worker stops
    heartbeating at its failure time (never, if it has none), or when the supervisor says it is fenced."""

    def __init__(self, supervisor: Any, interval_s: float, reply_timeout_s: float, seed: int):
        self._supervisor = supervisor
        self._interval_s = interval_s
        self._reply_timeout_s = reply_timeout_s
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._rtts: list[float] = []  # of heartbeats sent in the window and answered in time
        self._sent_in_window = 0
        self._timeouts = 0  # of heartbeats sent in the window
        self._last_sent: dict[int, float] = {}
        self._silenced: dict[int, float] = {}  # worker id -> when it skipped its first heartbeat

    async def pid(self) -> int:
        return os.getpid()

    async def run(self, worker_ids: list[int], start: float, window: tuple[float, float],
                  fail_at: dict[int, float], channel: HeartbeatChannel | None) -> dict[str, Any]:
        """Heartbeat for `worker_ids` from wall time `start` until `stop`, as datagrams to `channel` (None:
        as Ray calls); returns what was measured."""
        worker = self._worker
        if channel is not None:
            self._waiting: dict[tuple[int, int], asyncio.Future] = {}
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            widen_receive_buffer(sock)  # one socket here stands for thousands of workers' own
            sock.connect(("127.0.0.1", channel.port))
            self._transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _Replies(self._waiting), sock=sock)
            self._token = channel.token
            worker = self._datagram_worker
        await asyncio.sleep(max(0.0, start - time.time()))
        tasks = [asyncio.ensure_future(worker(w, self._rng.uniform(0, self._interval_s), fail_at.get(w, math.inf),
                                              window))
                 for w in worker_ids]
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"rtts": self._rtts, "sent_in_window": self._sent_in_window, "timeouts": self._timeouts,
                "last_sent": {w: self._last_sent.get(w) for w in fail_at}, "silenced": self._silenced}

    async def stop(self) -> None:
        self._stop.set()

    def _beat_due(self, worker_id: int, fail_at: float, window: tuple[float, float]) -> tuple[float, bool] | None:
        """A heartbeat is due now: (its send time, whether it is in the measured window); None once the
        worker's failure time has come (it falls silent)."""
        sent = time.time()
        if sent >= fail_at:
            self._silenced[worker_id] = sent
            return None
        self._last_sent[worker_id] = sent
        in_window = window[0] <= sent < window[1]
        self._sent_in_window += in_window
        return sent, in_window

    async def _worker(self, worker_id: int, phase: float, fail_at: float, window: tuple[float, float]) -> None:
        await asyncio.sleep(phase)
        while not self._stop.is_set():  # as well as the cancel: 3.11's wait_for may swallow one
            await asyncio.sleep(self._interval_s)
            if (beat := self._beat_due(worker_id, fail_at, window)) is None:
                return
            sent, in_window = beat
            call = asyncio.ensure_future(self._supervisor.heartbeat.remote(worker_id, 0, FACTS))
            while True:  # as worker/heartbeat.py: one heartbeat in flight, waited for rather than queued behind
                done, _ = await asyncio.wait({call}, timeout=self._interval_s * 4)
                if done or self._stop.is_set():
                    break
                self._timeouts += in_window
            if not done:
                return
            reply = call.result()
            if in_window:
                self._rtts.append(time.time() - sent)
            if reply.fenced:  # declared lost while alive: a real worker would rejoin as a new member
                return

    async def _datagram_worker(self, worker_id: int, phase: float, fail_at: float, window: tuple[float, float]) -> None:
        """A datagram every interval, whatever came back; a reply later than `heartbeat_reply_timeout_s`
        is a timeout. Stops once fenced."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(phase)
        seq, due, fenced = 0, loop.time(), asyncio.Event()

        def answered(sent: float, in_window: bool, reply: asyncio.Future) -> None:
            if reply.cancelled():
                self._timeouts += in_window
                return
            if in_window:
                self._rtts.append(time.time() - sent)
            if reply.result().fenced:
                fenced.set()

        while not self._stop.is_set() and not fenced.is_set():
            due += self._interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            if (beat := self._beat_due(worker_id, fail_at, window)) is None:
                return
            sent, in_window = beat
            seq += 1
            key = (worker_id, seq)
            reply = self._waiting[key] = loop.create_future()
            reply.add_done_callback(lambda r, t=sent, w=in_window: answered(t, w, r))
            loop.call_later(self._reply_timeout_s, lambda k=key: self._waiting.pop(k).cancel())
            self._transport.sendto(Beat(self._token, worker_id, seq, 0, FACTS["rss_bytes"], FACTS["cpu_percent"]).pack())


class _Replies(asyncio.DatagramProtocol):
    """Hands each reply datagram to the simulated worker waiting for it."""

    def __init__(self, waiting: dict[tuple[int, int], asyncio.Future]):
        self._waiting = waiting

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        answer = BeatReply.unpack(data)
        waiter = self._waiting.get((answer.worker_id, answer.seq)) if answer is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(answer.reply)


def _no_op() -> None:
    """The train function of the WorkerSpec: no worker is ever started."""


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _sleep_until(wall: float) -> None:
    time.sleep(max(0.0, wall - time.time()))


def run_workers(n: int, transport: str, spec: WorkerSpec, senders: int, failures: int, window_s: float,
                rng: random.Random) -> dict[str, Any]:
    """One N and transport ("udp" or "ray") on a fresh supervisor and fresh senders: steady-state costs,
    then detection of failures."""
    spec = dataclasses.replace(spec, elastic=dataclasses.replace(spec.elastic, heartbeat_udp=transport == "udp"))
    elastic = spec.elastic
    supervisor = ray.remote(ScaleSupervisor).options(num_cpus=0, max_concurrency=10_000).remote(
        spec, ScalingConfig(num_workers=n))
    actors = [ray.remote(HeartbeatSender).options(num_cpus=0).remote(
        supervisor, elastic.heartbeat_interval_s, elastic.heartbeat_reply_timeout_s, k) for k in range(senders)]
    try:
        sender_procs = [psutil.Process(pid) for pid in ray.get([a.pid.remote() for a in actors])]
        pid, channel = ray.get(supervisor.populate.remote(n))
        supervisor_proc = psutil.Process(pid)
        detect_ref = supervisor.detect.remote()
        start = time.time() + START_DELAY_S
        window = (start + WARMUP_S, start + WARMUP_S + window_s)
        failed = rng.sample(range(n), min(failures, n // 2))
        fail_at = {w: window[1] + STAGGER_S * i / len(failed) for i, w in enumerate(failed)}
        runs = [a.run.remote(list(range(k, n, senders)), start, window,
                             {w: t for w, t in fail_at.items() if w % senders == k}, channel)
                for k, a in enumerate(actors)]
        logger.info("%d workers over %s: %d senders; steady-state window %.0f s, then %d failures", n, transport,
                    senders, window_s, len(failed))

        _sleep_until(window[0])
        procs = [supervisor_proc, *sender_procs]
        for p in procs:
            p.cpu_percent(None)
        psutil.cpu_percent(None)
        _sleep_until(window[1])
        supervisor_cpu, *sender_cpus = (p.cpu_percent(None) for p in procs)
        machine_cpu = psutil.cpu_percent(None) * psutil.cpu_count()
        rss_mb = supervisor_proc.memory_info().rss / 2**20

        events: list[dict[str, Any]] = []
        deadline = window[1] + STAGGER_S + elastic.heartbeat_timeout_s + DETECT_GRACE_S
        _sleep_until(window[1] + STAGGER_S)
        while time.time() < deadline:
            events += ray.get(supervisor.events.remote(len(events)))
            if set(failed) <= {e["worker_id"] for e in events if e["kind"] == "worker_lost"}:
                break
            time.sleep(0.5)
        ray.get([a.stop.remote() for a in actors])
        results = ray.get(runs, timeout=60)
        ray.get(supervisor.stop_detecting.remote())
        ticks = ray.get(detect_ref, timeout=60)
        events += ray.get(supervisor.events.remote(len(events)))
    finally:
        for actor in (supervisor, *actors):
            ray.kill(actor)

    rtts = [r for res in results for r in res["rtts"]]
    last_sent = {w: t for res in results for w, t in res["last_sent"].items()}
    silenced = {w: t for res in results for w, t in res["silenced"].items()}
    lost = {e["worker_id"]: e["time"] for e in events if e["kind"] == "worker_lost"}
    # Declared lost while still heartbeating: the supervisor fell behind by more than the timeout.
    false_losses = sorted(w for w, t in lost.items() if t < silenced.get(w, math.inf))
    details = []
    for w in failed:
        detected = lost.get(w) if w in silenced and w not in false_losses else None
        details.append({
            "worker_id": w, "fail_at": fail_at[w], "last_heartbeat_sent": last_sent[w], "detected_at": detected,
            "silent_to_lost_s": _rounded(detected - last_sent[w]) if detected else None,
        })
    raw = [d["silent_to_lost_s"] for d in details if d["silent_to_lost_s"] is not None]
    delays = [r - elastic.heartbeat_timeout_s for r in raw]
    in_window = [t for t in ticks if window[0] <= t[0] < window[1]]
    scans = [scan for _, scan, _ in in_window]
    gaps = [b[0] - a[0] for a, b in zip(in_window, in_window[1:])]
    target = n / elastic.heartbeat_interval_s
    first, last = in_window[0], in_window[-1]
    rate = (last[2] - first[2]) / (last[0] - first[0])
    return {
        "workers": n,
        "transport": transport,
        "senders": senders,
        "target_heartbeats_per_s": round(target, 1),
        "heartbeats_per_s": round(rate, 1),
        "heartbeats_sent_per_s": round(sum(r["sent_in_window"] for r in results) / window_s, 1),
        "sustained": rate >= 0.9 * target,
        "supervisor_cpu_ms_per_heartbeat": _rounded(supervisor_cpu * 10 / rate if rate else None, 3),
        "heartbeat_rtt_ms_p50": _rounded(_percentile(rtts, 0.5) * 1e3 if rtts else None, 2),
        "heartbeat_rtt_ms_p99": _rounded(_percentile(rtts, 0.99) * 1e3 if rtts else None, 2),
        "heartbeat_timeouts": sum(r["timeouts"] for r in results),
        "supervisor_cpu_percent": round(supervisor_cpu, 1),
        "supervisor_rss_mb": round(rss_mb, 1),
        "senders_cpu_percent": round(sum(sender_cpus), 1),
        "machine_cpu_percent": round(machine_cpu, 1),
        "scan_ms_p50": _rounded(_percentile(scans, 0.5) * 1e3, 3),
        "scan_ms_p99": _rounded(_percentile(scans, 0.99) * 1e3, 3),
        "tick_gap_s_p99": _rounded(_percentile(gaps, 0.99)),
        "failures": len(failed),
        "detected": len(raw),
        "false_losses": len(false_losses),
        "detect_delay_s_p50": _rounded(_percentile(delays, 0.5)),
        "detect_delay_s_p99": _rounded(_percentile(delays, 0.99)),
        "silent_to_lost_s_p50": _rounded(_percentile(raw, 0.5)),
        "silent_to_lost_s_p99": _rounded(_percentile(raw, 0.99)),
        "failure_details": details,
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(report: dict[str, Any]) -> str:
    """The report's markdown table, and a line for each N this machine could not sustain."""
    lines = [f"heartbeat every {report['heartbeat_interval_s']} s, timeout {report['heartbeat_timeout_s']} s, "
             f"control tick {report['control_tick_s']} s; CPU % of one core", "",
             "| workers | transport | heartbeats/s served (target) | RTT p50 / p99 (timeouts) | supervisor CPU "
             "| per heartbeat | senders CPU | scan p50 / p99 | tick gap p99 | detected | false losses "
             "| delay beyond timeout p50 / p99 | last beat -> lost p50 / p99 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["runs"]:
        lines.append(
            f"| {r['workers']} | {r['transport']} | {r['heartbeats_per_s']:.0f} ({r['target_heartbeats_per_s']:.0f}) "
            f"| {_cell(r['heartbeat_rtt_ms_p50'], '.1f')} / {_cell(r['heartbeat_rtt_ms_p99'], '.1f')} ms "
            f"({r['heartbeat_timeouts']}) | {r['supervisor_cpu_percent']:.0f} % "
            f"| {_cell(r['supervisor_cpu_ms_per_heartbeat'], '.2f')} ms | {r['senders_cpu_percent']:.0f} % "
            f"| {_cell(r['scan_ms_p50'], '.2f')} / {_cell(r['scan_ms_p99'], '.2f')} ms "
            f"| {_cell(r['tick_gap_s_p99'], '.3f')} s | {r['detected']}/{r['failures']} | {r['false_losses']} "
            f"| {_cell(r['detect_delay_s_p50'], '.3f')} / {_cell(r['detect_delay_s_p99'], '.3f')} s "
            f"| {_cell(r['silent_to_lost_s_p50'], '.3f')} / {_cell(r['silent_to_lost_s_p99'], '.3f')} s |")
    for r in report["runs"]:
        if not r["sustained"]:
            lines.append(f"\n{r['workers']} workers over {r['transport']}: {r['heartbeats_per_s']:.0f} heartbeats/s served, "
                         f"{100 * r['heartbeats_per_s'] / r['target_heartbeats_per_s']:.0f} % of the target: this "
                         f"machine ({report['machine']['cpus']} cores, senders included) does not sustain it; its "
                         "figures are an overloaded control plane's.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100, 300, 1,000 workers, shorter windows")
    parser.add_argument("--workers", default=None,
                        help="comma-separated worker counts (default 100,1000,3000,10000; --quick 100,300,1000)")
    parser.add_argument("--senders", type=int, default=2, help="HeartbeatSender actors the workers are spread over")
    parser.add_argument("--failures", type=int, default=None, help="workers that stop heartbeating, per N "
                        "(default 20; --quick 10; at most half of N)")
    defaults = ElasticConfig()
    parser.add_argument("--interval", type=float, default=defaults.heartbeat_interval_s,
                        help="ElasticConfig.heartbeat_interval_s")
    parser.add_argument("--timeout", type=float, default=defaults.heartbeat_timeout_s,
                        help="ElasticConfig.heartbeat_timeout_s")
    parser.add_argument("--transports", default="udp,ray", help="comma-separated, of: udp, ray")
    parser.add_argument("--ray-max-workers", type=int, default=1000,
                        help="the largest N measured over Ray calls (past it this machine serves a fraction)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "scale", help="folder for scale.json")
    args = parser.parse_args()
    transports = args.transports.split(",")
    if unknown := set(transports) - {"udp", "ray"}:
        parser.error(f"unknown transports {sorted(unknown)}; choose from udp, ray")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    counts = [int(n) for n in (args.workers or ("100,300,1000" if args.quick else "100,1000,3000,10000")).split(",")]
    failures = args.failures or (10 if args.quick else 20)
    window_s = 5.0 if args.quick else 10.0
    elastic = ElasticConfig(heartbeat_interval_s=args.interval, heartbeat_timeout_s=args.timeout)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        with tempfile.TemporaryDirectory() as storage_path:
            storage = RunStorage(storage_path, "scale", None, RetryPolicy.of(elastic))
            spec = WorkerSpec.of(LoopSpec(_no_op, None), backend="gloo", elastic=elastic, storage=storage,
                                 run=RunInfo(storage.name), checkpointing=CheckpointConfig())
            rng = random.Random(0)
            runs = []
            for n in counts:
                for transport in transports:
                    if transport == "ray" and n > args.ray_max_workers:
                        continue
                    runs.append(run_workers(n, transport, spec, args.senders, failures, window_s, rng))
                    r = runs[-1]
                    logger.info("%d workers over %s: %.0f of %.0f heartbeats/s, supervisor %.0f %% CPU, detect delay "
                                "p50 %s s", n, transport, r["heartbeats_per_s"], r["target_heartbeats_per_s"],
                                r["supervisor_cpu_percent"], r["detect_delay_s_p50"])
    finally:
        ray.shutdown()
    report = {
        "benchmark": "scale",
        "machine": machine_facts(),
        "heartbeat_interval_s": elastic.heartbeat_interval_s,
        "heartbeat_timeout_s": elastic.heartbeat_timeout_s,
        "heartbeat_reply_timeout_s": elastic.heartbeat_reply_timeout_s,
        "control_tick_s": elastic.control_tick_s,
        "steady_state_window_s": window_s,
        "total_wall_s": round(time.monotonic() - started, 2),
        "runs": runs,
    }
    (out / "scale.json").write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + table(report))
    print(f"\ntotal {report['total_wall_s']:.1f} s; {out / 'scale.json'}")


if __name__ == "__main__":
    main()
