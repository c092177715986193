"""One recorded job (a lone node, a second node joins, a worker crashes, recovery, success), then:
its event log, the timeline built and drawn from it, and the metrics the same events produce.

The job runs once per module (about 20 s); each test reads what it left in its --log-dir.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import urllib.request
import zlib
from pathlib import Path

import pytest

from elastrun.config import LaunchConfig
from elastrun.observe import start_observability
from elastrun.observe.events import EventLog, read_log_dir
from elastrun.observe.timeline import build_timeline, load_timeline
from tests.harness import REPO, Cluster, base_env, free_port, listening, read_steps, wait_until

pytestmark = pytest.mark.e2e

RUN_ID = "obs-recorded"
JOB = Path(__file__).with_name("join_crash_job.py")


@pytest.fixture(scope="module")
def recorded() -> Path:
    """Run the job and return its log dir: node A alone (world 1), B joins (world 2), rank 1 crashes once.

    The worker (join_crash_job.py) steps alone until the join, whatever the machine's speed.
    """
    tmp = Path(tempfile.mkdtemp(prefix="elastrun-obs-"))
    steps_dir = tmp / "steps"
    steps_dir.mkdir()
    log_dir = tmp / "logs"
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="20", CRASH_ONCE_FILE=str(tmp / "crashed"))
    port = free_port()
    flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id={RUN_ID}", "--max-restarts=2", f"--log-dir={log_dir}"]
    cluster = Cluster(tmp)
    try:
        first = cluster.start(flags, [str(JOB)], env=env, name="first")
        wait_until(lambda: listening(port), 30, what="the store host to listen")
        wait_until(lambda: len(read_steps(steps_dir)) >= 5, 60, what="the lone node stepping")
        second = cluster.start(flags, [str(JOB)], env=env, name="second")
        assert first.wait(120) == 0, cluster.outputs()
        assert second.wait(60) == 0, cluster.outputs()
        yield log_dir
    finally:
        cluster.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def _kinds(events: list[dict], node: str) -> list[str]:
    return [e["event"] for e in events if e["node"] == node]


def _subsequence(wanted: list[str], kinds: list[str]) -> bool:
    it = iter(kinds)
    return all(any(k == w for k in it) for w in wanted)


def test_event_log_has_the_join_the_crash_and_the_recovery_in_order(recorded: Path) -> None:
    files = sorted(recorded.glob("events-*.jsonl"))
    assert len(files) == 2
    events = read_log_dir(recorded)
    first = events[0]["node"]
    second = next(e["node"] for e in events if e["node"] != first)
    assert all({"ts", "node", "event"} <= set(e) for e in events)
    # The lone node: a world of 1, then the join ends that group without charging the budget.
    assert _subsequence(
        ["agent_start", "round_start", "round_closed", "worker_start", "nodes_waiting", "restart",
         "round_start", "round_closed", "scale_change", "worker_start", "recovered",
         "round_start", "round_closed", "worker_start", "recovered", "worker_exit", "agent_exit"],
        _kinds(events, first),
    ), _kinds(events, first)
    assert _subsequence(["agent_start", "round_start", "round_closed", "worker_start", "round_start",
                         "round_closed", "worker_start", "worker_exit", "agent_exit"], _kinds(events, second))
    closed = [e for e in events if e["event"] == "round_closed" and e["node"] == first]
    assert [c["world_size"] for c in closed] == [1, 2, 2]
    assert [c["generation"] for c in closed] == [0, 1, 2]
    assert [c["restarts_used"] for c in closed] == [0, 0, 1]  # the join is free, the crash is charged
    assert all(c["members"] and c["duration"] >= 0 for c in closed)
    scale = next(e for e in events if e["event"] == "scale_change" and e["node"] == first)
    assert (scale["old_world_size"], scale["new_world_size"]) == (1, 2)
    failures = [e for e in events if e["event"] == "worker_failure"]
    # The crash; the peer's worker may also fail on the broken collective (same generation).
    injected = [e for e in failures if "injected failure at step 10" in e["message"]]
    assert len(injected) == 1 and injected[0]["rank"] == 1 and injected[0]["exitcode"] == 1
    assert {e["generation"] for e in failures} == {1}
    crash_ts = injected[0]["ts"]
    recovered = [e for e in events if e["event"] == "recovered" and e["ts"] > crash_ts]
    assert {e["node"] for e in recovered} == {first, second}
    assert all(0 <= e["duration"] < 30 for e in recovered)
    exits = [e for e in events if e["event"] == "agent_exit"]
    assert sorted(e["exitcode"] for e in exits) == [0, 0]


def test_timeline_model_shows_the_attempts_faults_and_world_size(recorded: Path) -> None:
    model = load_timeline(recorded)
    events = read_log_dir(recorded)
    first = events[0]["node"]
    assert model.run_id == RUN_ID and model.lanes[0] == first and len(model.lanes) == 2
    second = model.lanes[1]
    a = model.attempts_of(first)
    assert [x.generation for x in a] == [0, 1, 2]
    assert [x.outcome for x in a] == ["stopped", a[1].outcome, "finished"]
    b = model.attempts_of(second)
    assert [x.generation for x in b] == [1, 2] and b[-1].outcome == "finished"
    crashed = next(x for x in a + b if 1 in x.ranks and x.generation == 1)
    assert crashed.outcome == "failed"
    for x in model.attempts:
        assert 0 <= x.start < x.end <= model.duration + 1e-6
    fail = [m for m in model.marks_of("failure") if m.node == crashed.node]
    assert len(fail) == 1 and "rank 1: exit code 1" in fail[0].label
    assert "injected failure at step 10" in fail[0].detail
    assert abs(fail[0].t - crashed.end) < 1.0
    # The lone node after the join, both nodes after the crash (the newcomer had nothing to recover from).
    assert sorted(m.node for m in model.marks_of("recovered")) == sorted([first, first, second])
    assert [r.round for r in model.rounds] == sorted(r.round for r in model.rounds)
    assert [w for _, w in model.world_size] == [1, 2, 2]
    assert max(c for _, c in model.running) == 2 and model.running[-1][1] == 0


def test_workers_back_is_their_first_heartbeat_not_their_spawn(recorded: Path) -> None:
    events = read_log_dir(recorded)
    model = load_timeline(recorded)
    t0 = model.t0
    stepping = [e for e in events if e["event"] == "worker_stepping"]
    starts = {(e["node"], e["generation"], e["rank"]): e for e in events if e["event"] == "worker_start"}
    # Every worker of every generation stepped (the job ran to the end), each reported once.
    assert sorted((e["node"], e["generation"], e["rank"]) for e in stepping) == sorted(starts)
    for e in stepping:
        start = starts[(e["node"], e["generation"], e["rank"])]
        assert e["pid"] == start["pid"]
        assert start["ts"] <= e["first_heartbeat"] <= e["ts"]
        # torch's import and the process group's bootstrap come between the spawn and the first step.
        assert 0 < e["since_start"] < 60
    recovered = [e for e in events if e["event"] == "recovered"]
    marks = model.marks_of("recovered")
    assert len(marks) == len(recovered) == 3
    for e in recovered:
        fault = e["ts"] - e["duration"]
        gen = next(s["generation"] for s in reversed(events)
                   if s["event"] == "worker_start" and s["node"] == e["node"] and s["ts"] <= e["ts"])
        back = max(s["first_heartbeat"] for s in stepping if s["node"] == e["node"] and s["generation"] == gen)
        mark = next(m for m in marks if m.node == e["node"] and abs(m.t - (back - t0)) < 1e-6)
        assert mark.label == f"{back - fault:.1f} s"
        assert back - fault > e["duration"], "stepping again comes after the spawn"
        assert "stepping again" in mark.detail


def test_a_recovery_without_heartbeats_is_shown_as_started_only() -> None:
    node = "n1"
    events = [
        {"ts": 100.0, "node": node, "event": "agent_start", "run_id": "x", "hostname": "h", "pid": 1},
        {"ts": 101.0, "node": node, "event": "worker_start", "generation": 0, "round": 1, "rank": 0, "pid": 10},
        {"ts": 105.0, "node": node, "event": "worker_failure", "generation": 0, "rank": 0, "exitcode": 1},
        {"ts": 105.5, "node": node, "event": "round_start"},
        {"ts": 106.0, "node": node, "event": "worker_start", "generation": 1, "round": 2, "rank": 0, "pid": 11},
        {"ts": 106.0, "node": node, "event": "recovered", "round": 2, "reason": "the failure of rank 0",
         "duration": 1.0},
        {"ts": 110.0, "node": node, "event": "agent_exit", "exitcode": 0},
    ]
    (mark,) = build_timeline(events).marks_of("recovered")
    assert (mark.t, mark.label) == (6.0, "1.0 s (started)")
    assert "send no heartbeats" in mark.detail
    events.insert(6, {"ts": 108.0, "node": node, "event": "worker_stepping", "generation": 1, "rank": 0,
                      "pid": 11, "first_heartbeat": 107.5, "since_start": 1.5})
    (mark,) = build_timeline(events).marks_of("recovered")
    assert (mark.t, mark.label) == (7.5, "2.5 s")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    crc = struct.unpack(">I", data[29:33])[0]
    assert zlib.crc32(data[12:29]) == crc, "corrupt IHDR chunk"
    assert data[-8:-4] == b"IEND"
    return width, height


def test_timeline_command_writes_a_png_and_html(recorded: Path, tmp_path: Path) -> None:
    png, html, js = tmp_path / "t.png", tmp_path / "t.html", tmp_path / "t.json"
    res = subprocess.run([sys.executable, "-m", "elastrun", "timeline", str(recorded), "-o", str(png),
                          "--html", str(html), "--json", str(js)],
                         cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    width, height = _png_size(png)
    assert 1000 <= width <= 3000 and 400 <= height <= 2000, (width, height)
    assert 20_000 < png.stat().st_size < 2_000_000
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "injected failure at step 10" in page  # the failure's message is on the page
    doc = json.loads(js.read_text())
    assert [w for _, w in doc["world_size"]] == [1, 2, 2]


def test_timeline_of_a_directory_without_events_is_a_clear_error(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "elastrun", "timeline", str(tmp_path), "-o", str(tmp_path / "x.png")],
                         cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "no events-*.jsonl files under" in res.stderr
    assert not (tmp_path / "x.png").exists()


def test_metrics_endpoint_serves_the_recorded_events_as_prometheus_text(recorded: Path) -> None:
    events = read_log_dir(recorded)
    first = events[0]["node"]
    log = EventLog(first)
    handle = start_observability(LaunchConfig(entrypoint="x", run_id=RUN_ID, metrics_port=0), log)
    try:
        assert handle.metrics_url and handle.metrics_url.startswith("http://127.0.0.1:")
        port = int(handle.metrics_url.rsplit(":", 1)[1].split("/")[0])
        for e in events:
            if e["node"] == first:
                log.emit(e["event"], **{k: v for k, v in e.items() if k not in ("ts", "node", "event")})
        with urllib.request.urlopen(handle.metrics_url, timeout=5) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = reply.read().decode()
    finally:
        handle.close(log)
    labels = f'node="{first}",run_id="{RUN_ID}"'
    assert f"elastrun_rounds_total{{{labels}}} 3" in text
    assert f"elastrun_worker_starts_total{{{labels}}} 3" in text
    # Two restarts: the join (membership) and the crash (seen as a membership change or as a local
    # failure, depending on whether this node's worker noticed its peer's death first).
    restarts = {line.split('cause="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("elastrun_restarts_total{")}
    assert sum(restarts.values()) == 2 and restarts.get("membership", 0) >= 1, restarts
    assert f"elastrun_world_size{{{labels}}} 2" in text
    assert f"elastrun_restarts_max{{{labels}}} 2" in text
    assert f"elastrun_recovery_seconds_count{{{labels}}} 2" in text
    assert "# TYPE elastrun_rendezvous_seconds summary" in text
    assert f"elastrun_workers_running{{{labels}}} 0" in text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.startswith("elastrun_")
    # The port is released on close (SO_REUSEADDR: the scrape's connection may linger in TIME_WAIT).
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
