"""Seeing a run: its metrics in Ray's Prometheus endpoint; its event log (`events.jsonl`) written as
the run goes, read while it is still going and after its driver died, and kept across a supervisor
that Ray restarted; what fit() shows."""

from __future__ import annotations

import io
import json
import socket
import urllib.request
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster
from rich.console import Console

import elastic_train as et
from elastic_train.checkpoint.layout import CommittedCheckpoint
from elastic_train.checkpoint.manifest import Manifest
from elastic_train.checkpoint.storage import RunStorage
from elastic_train.driver.launch import attach
from elastic_train.progress import Progress
from elastic_train.protocol import Feed, ReportRecord
from elastic_train.run_folder.event_log import EVENT_LOG, EventLog, read_events
from tests.conftest import ray_runtime_env, stop_ray
from tests.helpers import fit_in_background, make_trainer, wait_for
from tests.loops import read_progress


@pytest.fixture(params=["local", "s3"])
def run_storage(request, tmp_path):
    """A run's storage on local disk (appended to) and on S3 (written whole)."""
    if request.param == "local":
        storage = RunStorage(str(tmp_path), "run")
    else:
        bucket = request.getfixturevalue("s3_bucket")
        storage = RunStorage(bucket["url"], "run", bucket["options"])
    storage.check_writable()
    return storage


# == metrics, through Ray's metrics agent (supervisor/watch/metrics.py) ===================================
@pytest.fixture
def metrics_cluster():
    """A head (0 CPUs) exporting Prometheus metrics on a known port, every 0.2 s, and 2 nodes of 1 CPU:
    yields (cluster, nodes, port). The supervisor lives on the head, so its metrics are served there."""
    stop_ray()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "metrics_export_port": port, "_system_config": {"metrics_report_interval_ms": 200}})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=ray_runtime_env())
    yield cluster, nodes, port
    ray.shutdown()
    cluster.shutdown()


def scrape(port: int, run: str = "run") -> dict[tuple[str, frozenset], float]:
    """Our series for `run` on a node's Prometheus endpoint, as prometheus_client parses them:
    (name without Ray's and our prefixes, {rank, cause, state, le}) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    prefix = "ray_elastic_train_"
    return {(s.name[len(prefix):], frozenset((k, v) for k, v in s.labels.items() if k in ("rank", "cause", "state"))):
            s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix) and s.labels.get("run") == run and "le" not in s.labels}


def metric(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.mark.timeout(240)
def test_metrics_in_rays_prometheus_endpoint_follow_the_run(metrics_cluster, run_dirs):
    """Scraped while the run goes: a slow rank flagged; the world size dropping when a node is lost
    and coming back when one joins; the loss counted by its cause; recovery timed; step times,
    stalls, memory and heartbeats per rank; uploads (of the dict checkpoint every rank reports: rank
    0's alone) and commits."""
    cluster, nodes, port = metrics_cluster
    elastic = et.ElasticConfig(metrics_interval_s=0.2, event_log_interval_s=0.2)
    steps = 160
    # Steps enough that the survivor alone cannot finish before a worker is placed on the new node and warmed up.
    join = fit_in_background(make_trainer(run_dirs, (1, 2), steps=steps, step_time=0.05, slow_rank=1, slow_s=0.2,
                                          elastic=elastic))
    storage = RunStorage(run_dirs["storage"], "run")
    wait_for(lambda: metric(scrape(port), "straggler", rank="1") == 1, 90, "rank 1 flagged a straggler")
    flagged = [e for e in read_events(storage) if e["kind"] == "straggler"]
    assert [e["rank"] for e in flagged] == [1] and flagged[0]["index"] <= 10, flagged
    samples = scrape(port)
    assert metric(samples, "world_size") == 2 and metric(samples, "straggler", rank="0") == 0
    assert metric(samples, "state", state="RUNNING") == 1 and metric(samples, "state", state="RESTARTING") == 0

    rank1 = next(p for p in reversed(read_progress(run_dirs["log_dir"])) if p["rank"] == 1)
    cluster.remove_node(next(n for n in nodes if n.node_id == rank1["node"]))
    wait_for(lambda: metric(scrape(port), "world_size") == 1, 60, "the world size to drop to 1")
    cluster.add_node(num_cpus=1)
    wait_for(lambda: metric(scrape(port), "world_size") == 2, 90, "the world size to come back to 2")
    samples = wait_for(lambda: (lambda s: metric(s, "recovery_seconds_count") and metric(s, "steps_per_second")
                                and s)(scrape(port)), 30, "the recovery timed and steps made at 2 again")
    assert "run_ended" not in [e["kind"] for e in read_events(storage)], "scraped after the run"
    assert metric(samples, "generation") >= 2
    assert metric(samples, "workers_lost_total", cause="died") == 1
    assert metric(samples, "recovery_seconds_sum") > 0
    for rank in ("0", "1"):
        assert metric(samples, "step_seconds_count", rank=rank) > 0
        assert metric(samples, "report_stall_seconds_count", rank=rank) > 0
        assert metric(samples, "worker_rss_bytes", rank=rank) > 50 * 2**20  # a Python process with torch
        assert 0 <= metric(samples, "heartbeat_age_seconds", rank=rank) < elastic.heartbeat_timeout_s
    # Every rank reports the same dict checkpoint: one rank's part is all of it, so rank 0 alone uploads it.
    assert metric(samples, "checkpoint_upload_bytes_total", rank="0") > 0
    assert metric(samples, "checkpoint_upload_seconds_count", rank="0") > 0
    assert not metric(samples, "checkpoint_upload_bytes_total", rank="1")
    assert metric(samples, "checkpoint_commit_seconds_count") > 0
    assert metric(samples, "checkpoint_committed_bytes_total") > 0
    assert 0 < metric(samples, "goodput") <= 1
    result = join(150)
    assert result.error is None and result.metrics["step"] == steps
    lost = [e for e in result.events if e["kind"] == "worker_lost" and not e["spare"]]  # the node's spare went too
    assert [e["cause"] for e in lost] == ["died"], lost


@pytest.mark.timeout(30)
def test_the_event_log_is_written_as_it_goes_and_a_restarted_supervisor_appends(run_storage):
    storage = run_storage
    first = EventLog(storage, go_on=False)
    first.entries += [{"kind": "run_started"}, {"kind": "worker_lost", "reason": "died"}]
    first.flush()
    assert read_events(storage) == first.entries
    first.entries.append({"kind": "generation"})  # recorded after the last flush: lost with its supervisor
    restarted = EventLog(storage, go_on=True)
    assert restarted.entries == [{"kind": "run_started"}, {"kind": "worker_lost", "reason": "died"}]
    assert restarted.inherited == 2
    restarted.entries.append({"kind": "supervisor_restarted"})
    restarted.flush()
    assert [e["kind"] for e in read_events(storage)] == ["run_started", "worker_lost", "supervisor_restarted"]
    # A new fit() of a run with this name starts a log of its own at its first flush, even an empty one.
    EventLog(storage, go_on=False).flush()
    assert read_events(storage) == []


@pytest.mark.timeout(10)
def test_a_damaged_event_log_is_named_and_a_restarted_supervisor_writes_it_anew(tmp_path):
    storage = RunStorage(str(tmp_path), "run")
    storage.check_writable()
    (tmp_path / "run" / EVENT_LOG).write_text('{"kind": "run_started"}\n{"kind": ')  # a crash mid-append
    assert read_events(storage) == [{"kind": "run_started"}]
    (tmp_path / "run" / EVENT_LOG).write_text('{"kind": "run_started"}\n{"kind": \n{"kind": "generation"}\n')
    with pytest.raises(et.ConfigError, match=r"events.jsonl is not JSON lines .*damaged"):
        read_events(storage)
    log = EventLog(storage, go_on=True)
    assert log.entries == [] and log.inherited == 0
    log.entries.append({"kind": "supervisor_restarted"})
    log.flush()
    assert read_events(storage) == [{"kind": "supervisor_restarted"}]
    # A supervisor killed mid-append leaves a torn line: its successor writes the log whole again,
    # so the torn piece never ends up in the middle of the file.
    with open(tmp_path / "run" / EVENT_LOG, "a") as f:
        f.write('{"kind": "gener')
    successor = EventLog(storage, go_on=True)
    assert successor.entries == [{"kind": "supervisor_restarted"}]
    successor.entries.append({"kind": "generation"})
    successor.flush()
    successor.entries.append({"kind": "run_ended"})
    successor.flush()  # appended after a whole file
    assert [e["kind"] for e in read_events(storage)] == ["supervisor_restarted", "generation", "run_ended"]


@pytest.mark.timeout(180)
def test_a_lost_worker_is_in_the_event_log_while_the_run_goes_on(local_ray, run_dirs):
    trainer = make_trainer(run_dirs, 2, steps=40, step_time=0.05, fault={"kind": "kill", "at_step": 5, "rank": 1},
                           elastic=et.ElasticConfig(event_log_interval_s=0.2))
    join = fit_in_background(trainer)
    storage = RunStorage(run_dirs["storage"], "run")
    lost = wait_for(lambda: [e for e in read_events(storage) if e["kind"] == "worker_lost"], 60,
                    "the lost worker in events.jsonl")
    killed = json.loads(Path(run_dirs["log_dir"], "fault.json").read_text())
    assert lost[0]["pid"] == killed["pid"] and lost[0]["cause"] == "died" and lost[0]["reason"]
    kinds = [e["kind"] for e in read_events(storage)]
    assert "run_ended" not in kinds and max(p["step"] for p in read_progress(run_dirs["log_dir"])) < 40
    result = join(150)
    assert result.events == read_events(storage) == et.Result.from_path(result.path).events
    assert [e["kind"] for e in result.events][-1] == "run_ended"


@pytest.mark.timeout(180)
def test_after_a_supervisor_restart_the_log_holds_both_supervisors_events(local_ray, run_dirs):
    trainer = make_trainer(run_dirs, 2, steps=40, step_time=0.05, elastic=et.ElasticConfig(event_log_interval_s=0.2))
    join = fit_in_background(trainer)
    wait_for(lambda: len(read_progress(run_dirs["log_dir"])) >= 10, 60, "training to start")
    storage = RunStorage(run_dirs["storage"], "run")
    wait_for(lambda: any(e["kind"] == "generation" for e in read_events(storage)), 30, "the first generation logged")
    ray.kill(attach("run"), no_restart=False)
    result = join(150)
    kinds = [e["kind"] for e in read_events(storage)]
    assert kinds[0] == "run_started" and "generation" in kinds[:kinds.index("supervisor_restarted")]
    assert kinds.count("supervisor_restarted") == 1 and kinds[-1] == "run_ended"
    assert result.events == read_events(storage)
    assert result.metrics["step"] == 40  # (the history before the restart is the restarted supervisor's known gap)


@pytest.mark.timeout(120)
def test_a_slow_rank_is_flagged_a_straggler_within_10_reports(local_ray, run_dirs):
    result = make_trainer(run_dirs, 2, steps=12, step_time=0.02, slow_rank=1, slow_s=0.2).fit()
    flagged = [e for e in result.events if e["kind"] == "straggler"]
    assert [e["rank"] for e in flagged] == [1], flagged
    # After straggler_reports (5) slow reports in a row; the first report's time is mostly set-up, alike.
    assert et.ElasticConfig().straggler_reports <= flagged[0]["index"] <= 10, flagged
    assert flagged[0]["step_s"] > 0.2 > flagged[0]["median_step_s"]
    assert not [e for e in result.events if e["kind"] == "straggler_cleared"]


# == what fit() shows (progress.py) =================================================================
def _feed(reports=(), events=()) -> Feed:
    return Feed(list(reports), list(events), 0, 0, over=False)


GENERATION = {"kind": "generation", "generation": 1, "world_size": 2, "resume_from": "memory", "resume_index": 4}
LOST = {"kind": "worker_lost", "worker_id": 3, "rank": 1, "pid": 99, "cause": "died", "reason": "actor died"}
COMMITTED = {"kind": "checkpoint_committed", "index": 5}


def _shown(verbosity: int, terminal: bool, feeds: list[Feed], clock: list[float]) -> str:
    out = io.StringIO()
    progress = Progress("demo", verbosity, 10.0, Console(file=out, width=200, force_terminal=terminal),
                        clock=lambda: clock[0])
    for feed in feeds:
        clock[0] += 6
        progress.update(feed)
    progress.close()
    return out.getvalue()


@pytest.mark.timeout(10)
def test_progress_without_a_terminal_prints_events_and_a_status_line_every_interval():
    committed = CommittedCheckpoint(5, "/x/checkpoint_5", Manifest(5, 1, 2, {}))
    feeds = [_feed(events=[GENERATION]), _feed([ReportRecord(5, 1, 2, [{"loss": 0.25}, {}], committed)], [COMMITTED]),
             _feed(events=[LOST])]
    lines = _shown(1, False, feeds, [0.0]).splitlines()
    assert lines == [
        "[demo] generation 1: world size 2, resumed from memory at report 4",
        "[demo] report 5 | loss=0.25 | world size 2 | generation 1 | checkpoint 5 | 00:12",  # 10 s passed
        "[demo] worker 3 (rank 1, pid 99) lost, died: actor died",
        "[demo] report 5 | loss=0.25 | world size 2 | generation 1 | checkpoint 5 | 00:18",  # at the end
    ]
    assert _shown(0, False, feeds, [0.0]) == ""
    everything = _shown(2, False, feeds, [0.0])
    assert "[demo] report 5: loss=0.25" in everything and "[demo] checkpoint_committed: index=5" in everything


@pytest.mark.timeout(10)
def test_progress_names_why_a_loop_was_re_entered_with_or_without_a_checkpoint():
    why = "train.py:23 holds the world size it read (2, now 1)"
    reentered = {**GENERATION, "generation": 2, "world_size": 1, "reentered_because": why}
    fresh = {**reentered, "generation": 3, "resume_from": None, "resume_index": None}
    lines = _shown(1, False, [_feed(events=[reentered]), _feed(events=[fresh])], [0.0]).splitlines()
    assert lines[:2] == [f"[demo] generation 2: world size 1, resumed from memory at report 4 (re-entered: {why})",
                         f"[demo] generation 3: world size 1, from the start (re-entered: {why})"]


@pytest.mark.timeout(10)
def test_progress_on_a_terminal_redraws_its_status_line():
    shown = _shown(1, True, [_feed(events=[GENERATION]), _feed(events=[LOST])], [0.0])
    assert "generation 1: world size 2" in shown and "lost, died: actor died" in shown
    assert "\x1b[" in shown and shown.count("world size 2 | generation 1") >= 2  # redrawn in place


@pytest.mark.timeout(10)
def test_verbosity_is_checked():
    with pytest.raises(et.ConfigError, match=r"ElasticConfig.verbosity=5: use 0 \(quiet\), 1"):
        et.ElasticConfig(verbosity=5)


class _ClosedStream(io.StringIO):
    def write(self, text):
        raise ValueError("I/O operation on closed file")


@pytest.mark.timeout(10)
def test_a_failing_progress_display_turns_itself_off_instead_of_stopping_the_run(caplog):
    progress = Progress("demo", 1, 0.0, Console(file=_ClosedStream(), force_terminal=False))
    progress.update(_feed(events=[GENERATION]))  # would raise into fit()'s loop without the guard
    assert "progress display is off" in caplog.text
    progress.update(_feed(events=[LOST]))
    progress.close()
