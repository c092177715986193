"""The goodput computation on histories whose every second is known, its step records, its words and metrics.

``compute`` is a pure function of events and step records: these tests write both by hand (a
node's agent events as the agent emits them, the records through the real writer into real
files) and check each cause to the millisecond.  The end-to-end check against a real job with
real faults is test_goodput_accuracy.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastrun.config import LaunchConfig
from elastrun.observe import start_observability
from elastrun.observe.events import EventLog
from elastrun.observe.goodput import CAUSES, compute
from elastrun.observe.goodput_report import GoodputTracker, format_breakdown, read_logs, summary_line, to_json
from elastrun.observe.status_view import format_status
from elastrun.shared.steplog import BLOCKED, GROW, RESTORE, STEP, ProcessLog, Record, StepLog, read

pytestmark = pytest.mark.unit

NODE = "host-1-abcd"
T = 1_000_000.0


def ev(t: float, event: str, **fields) -> dict:
    return {"ts": T + t, "node": NODE, "event": event, **fields}


def step(n: int, t0: float, t1: float, t2: float) -> Record:
    return Record(STEP, None, 0, 0, 1, n, T + t0, T + t1, T + t2)


def restore(step_: int, t0: float, t1: float, source: str | None) -> Record:
    return Record(RESTORE, source, 0, 0, 1, step_, T + t0, T + t1, T + t1)


def start(t: float = 0.0) -> list[dict]:
    return [ev(t, "agent_start", run_id="job", nproc=1, pid=1, hostname="host"), ev(t + 0.5, "round_start"),
            ev(t + 1.0, "round_closed", round=0, generation=0, world_size=1, members=[NODE]),
            ev(t + 1.0, "worker_start", round=0, generation=0, rank=0, local_rank=0, pid=100, start_method="fork")]


def test_a_clean_run_is_split_exactly() -> None:
    events = [*start(), ev(12.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None),
              ev(12.5, "agent_exit", exitcode=0)]
    recs = [restore(0, 2.0, 2.5, None)] + [step(i + 1, 2.5 + i, 3.4 + i, 3.5 + i) for i in range(9)]
    recs.append(Record(BLOCKED, None, 0, 0, 1, 0, T + 11.5, T + 11.8, T + 11.8))
    gp = compute(events, {(NODE, 100): ProcessLog(100, NODE, T + 1.0, recs)})
    assert gp.device_seconds == pytest.approx(12.5)
    assert gp.good == pytest.approx(9 * 0.9)
    assert gp.badput["commit"] == pytest.approx(9 * 0.1 + 0.3)
    assert gp.badput["startup"] == pytest.approx(0.5 + 1.0)  # agent set-up, then process start to restore
    assert gp.badput["rendezvous"] == pytest.approx(0.5)
    assert gp.badput["restore"] == pytest.approx(0.5)
    assert gp.badput["idle"] == pytest.approx(0.2 + 0.5)  # the script's end, then the exit barrier
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)
    assert gp.wall_good + sum(gp.wall_badput.values()) == pytest.approx(gp.wall)
    assert gp.faults == [] and gp.basis == "steps"
    assert summary_line(gp).startswith("goodput 64.8 % of 1 worker(s) x 12.5 s")


def test_a_crash_rolls_back_steps_and_charges_them_to_its_fault() -> None:
    events = [*start(),
              ev(6.2, "worker_exit", pid=100, local_rank=0, exitcode=None, signal="SIGKILL"),
              ev(6.21, "worker_failure", round=0, rank=0, local_rank=0, exitcode=None, signal="SIGKILL", message=""),
              ev(6.3, "round_start", after=0),
              ev(6.5, "round_closed", round=1, generation=1, world_size=1, members=[NODE]),
              ev(6.5, "worker_start", round=1, generation=1, rank=0, local_rank=0, pid=101, start_method="fork"),
              ev(6.6, "recovered", round=1, reason="the failure of rank 0", duration=0.4),
              ev(12.0, "worker_exit", pid=101, local_rank=0, exitcode=0, signal=None),
              ev(12.0, "agent_exit", exitcode=0)]
    first = [restore(0, 1.5, 2.0, None)] + [step(i + 1, 2.0 + i, 2.9 + i, 3.0 + i) for i in range(4)]
    # the snapshot of step 4 was not complete: the new process restores step 2 and redoes 3 and 4
    second = [restore(2, 7.0, 7.5, "memory")] + [step(3 + i, 7.5 + i, 8.4 + i, 8.5 + i) for i in range(4)]
    logs = {(NODE, 100): ProcessLog(100, NODE, T + 1, first), (NODE, 101): ProcessLog(101, NODE, T + 6.5, second)}
    gp = compute(events, logs)
    (fault,) = gp.faults
    assert fault.kind == "worker_failure" and fault.label == "rank 0 killed by SIGKILL"
    assert fault.at == pytest.approx(T + 6.2, abs=0.01) and fault.back == pytest.approx(T + 7.5, abs=0.01)
    assert gp.badput["redone"] == pytest.approx(2 * 1.0 + 0.2)  # steps 3 and 4, then the cut step 6.0-6.2
    assert fault.cost["redone"] == pytest.approx(2.2)
    assert gp.good == pytest.approx(2 * 0.9 + 4 * 0.9)
    assert fault.cost["restart"] == pytest.approx(0.1 + 0.5)  # stop 6.2-6.3, new process 6.5-7.0
    assert fault.cost["rendezvous"] == pytest.approx(0.2)
    assert fault.cost["restore"] == pytest.approx(0.5)
    assert gp.restore_sources == {"fresh-start": pytest.approx(0.5), "memory": pytest.approx(0.5)}
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)
    line = summary_line(gp)
    assert "redone steps 2.2 s (rank 0 killed by SIGKILL at 6 s)" in line, line
    assert "fault 1 at 6.2 s: rank 0 killed by SIGKILL" in format_breakdown(gp)


def test_heartbeats_alone_measure_stepping_and_say_what_is_unknown() -> None:
    events = [*start(), ev(3.0, "worker_stepping", round=0, generation=0, rank=0, local_rank=0, pid=100,
                           first_heartbeat=T + 2.5, since_start=1.5),
              ev(10.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None), ev(10.0, "agent_exit")]
    gp = compute(events, {})
    assert gp.basis == "heartbeats"
    assert gp.good == pytest.approx(7.5) and gp.badput["startup"] == pytest.approx(2.0)
    assert "from heartbeats only: redone steps unknown" in summary_line(gp)


def test_workers_without_heartbeats_are_not_measured() -> None:
    events = [*start(), ev(10.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None),
              ev(10.0, "agent_exit")]
    gp = compute(events, {})
    assert gp.basis == "none" and gp.good == 0 and gp.badput["unknown"] == pytest.approx(9.0)
    assert summary_line(gp).startswith("goodput not measured")


def test_a_running_job_is_measured_up_to_now() -> None:
    recs = [restore(0, 1.5, 2.0, None)] + [step(i + 1, 2.0 + i, 2.9 + i, 3.0 + i) for i in range(3)]
    gp = compute(start(), {(NODE, 100): ProcessLog(100, NODE, T + 1, recs)}, now=T + 5.5)
    assert gp.live and gp.end == T + 5.5
    assert gp.good == pytest.approx(3 * 0.9 + 0.5)  # the step in progress counts, for now
    assert to_json(gp)["live"] is True
    assert summary_line(gp).startswith("goodput so far ")  # says it is not the final figure


def test_the_figure_at_the_exit_barrier_is_the_final_one() -> None:
    """Issue 34: the agent's last line said 48.6 % and ``elastrun goodput`` 43.2 % for one run.  The
    agent measured before logging its exit, so its group still looked open and the script's end after
    the last step (here 3 s of 12.5) counted as a step in progress.  A group whose workers have all
    finished is over, whether the agent has exited or not; and a job whose every node exited is not
    live, whatever ``now`` is."""
    recs = [restore(0, 1.5, 2.0, None)] + [step(i + 1, 2.0 + i, 2.9 + i, 3.0 + i) for i in range(6)]
    logs = {(NODE, 100): ProcessLog(100, NODE, T + 1, recs)}
    finished = [*start(), ev(11.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None)]
    final = compute([*finished, ev(12.5, "agent_exit", exitcode=0)], logs)
    at_the_barrier = compute(finished, logs, now=T + 12.5)
    assert final.good == pytest.approx(6 * 0.9) and final.badput["idle"] == pytest.approx(3.0 + 1.5)
    assert at_the_barrier.good == pytest.approx(final.good)
    assert at_the_barrier.badput == pytest.approx(final.badput)
    assert at_the_barrier.live and summary_line(at_the_barrier).startswith("goodput so far 43.2 %")
    assert summary_line(final).startswith("goodput 43.2 %")
    read_later = compute([*finished, ev(12.5, "agent_exit", exitcode=0)], logs, now=T + 99.0)  # elastrun status
    assert not read_later.live and summary_line(read_later) == summary_line(final)


def test_step_records_round_trip_through_the_mapped_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRUN_NODE_ID", NODE)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ELASTRUN_ROUND", "7")
    path = tmp_path / "attempt_0" / "rank_3" / f"steps-{os.getpid()}.bin"
    log = StepLog(path)
    assert log.active
    log.restored(1.0, 5, "peer")
    for i in range(GROW + 10):  # past the first mapping: it grows
        log.step(6 + i, 2.0)
        if i == 3:
            live = read(path)  # a reader of the live file sees the records so far and stops there
            assert live is not None and len(live.records) == 5
    log.blocked(3.0)
    got = read(path)
    log.close()
    assert got is not None and got.pid == os.getpid() and got.node == NODE
    assert len(got.records) == GROW + 12
    first, second, last = got.records[0], got.records[1], got.records[-1]
    assert (first.kind, first.source, first.step, first.round, first.rank, first.world) == (RESTORE, "peer", 5, 7, 3, 4)
    assert second.kind == STEP and second.step == 6 and second.t0 == first.t1 and second.t1 == 2.0
    assert last.kind == BLOCKED and last.t0 == 3.0
    assert list(read_logs([tmp_path])) == [(NODE, os.getpid())]


def test_outside_an_agent_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastrun.shared.steplog import default_path

    monkeypatch.delenv("ELASTRUN_NODE_ID", raising=False)
    monkeypatch.delenv("ELASTRUN_STEP_LOG", raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # torchrun sets it too
    assert default_path() is None
    log = StepLog(None)
    log.step(1, 0.0)  # a no-op
    assert not log.active and not list(tmp_path.iterdir())


def test_the_agents_tracker_feeds_the_summary_line_and_the_metrics(tmp_path: Path) -> None:
    config = LaunchConfig(entrypoint="x.py", run_id="job", metrics_port=None, log_dir=str(tmp_path))
    events = EventLog(NODE)
    obs = start_observability(config, events)
    try:
        for e in start():
            events.emit(e.pop("event"), **{k: v for k, v in e.items() if k not in ("ts", "node")})
        events.emit("worker_stepping", round=0, generation=0, rank=0, local_rank=0, pid=100,
                    first_heartbeat=__import__("time").time(), since_start=0.1)
        text = obs.registry.render()
        assert "elastrun_goodput_ratio{" in text and 'elastrun_badput_seconds{cause="startup"' in text
        for cause in CAUSES:
            assert f'cause="{cause}"' in text
        events.emit("worker_exit", pid=100, local_rank=0, exitcode=0, signal=None)
        events.emit("agent_exit", exitcode=0)
        assert obs.goodput.summary_line().startswith("goodput ")
        assert obs.goodput.summary_line() == summary_line(obs.goodput.compute())
    finally:
        obs.close(events)
        events.close()


def test_a_broken_history_gives_a_line_not_an_exception() -> None:
    tracker = GoodputTracker()
    assert tracker.summary_line() == "goodput not measured: no events"
    tracker({"node": NODE, "event": "agent_start"})  # no time stamp
    assert tracker.summary_line().startswith("goodput not")


def test_status_shows_goodput_so_far() -> None:
    doc = {"run_id": "job", "backend": "c10d", "endpoint": "h:1", "state": "running", "round": None,
           "goodput": {"summary": "goodput so far 90.0 % of 2 worker(s) x 10.0 s (wall 91.0 %); no badput"}}
    assert "\ngoodput so far 90.0 % of 2 worker(s)" in format_status(doc)
    doc["goodput"] = {"error": "no events-*.jsonl files under /x"}
    assert "goodput: not available (no events-*.jsonl files under /x)" in format_status(doc)


def test_goodput_command_on_a_directory_without_events_is_one_line_and_exit_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from elastrun.observe.cli import main

    assert main(["goodput", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no events-*.jsonl files under" in err and "--log-dir" in err
    assert main(["goodput", str(tmp_path / "missing")]) == 1
    assert "is not a directory" in capsys.readouterr().err


def test_the_snapshot_spacing_chosen_on_a_gpu_is_in_the_breakdown_and_changes_nothing_else(tmp_path) -> None:
    """A worker whose snapshots were spaced by their cost (``SPACING`` records, written by the real
    writer) gets a line in the breakdown; the records count for no time and split no span."""
    events = [*start(), ev(12.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None),
              ev(12.5, "agent_exit", exitcode=0)]
    recs = [restore(0, 2.0, 2.5, None)] + [step(i + 1, 2.5 + i, 3.4 + i, 3.5 + i) for i in range(9)]
    plain = compute(events, {(NODE, 100): ProcessLog(100, NODE, T + 1.0, recs)})
    writer = StepLog(tmp_path / "steps-100.bin")

    class Meter:
        step_s, cost_s = 0.06, 0.012

    writer.spacing(4, Meter())
    writer.close()
    (spacing,) = read(tmp_path / "steps-100.bin").records
    spaced = recs[:5] + [spacing._replace(t2=T + 5.6)] + recs[5:]
    gp = compute(events, {(NODE, 100): ProcessLog(100, NODE, T + 1.0, spaced)})
    assert gp.snapshots == (4, 0.06, 0.012) and plain.snapshots is None
    assert gp.good == pytest.approx(plain.good) and gp.badput == pytest.approx(plain.badput)
    assert len(gp.spans) == len(plain.spans)
    assert "snapshots: every 4 step(s), chosen from their measured cost (12.0 ms each = 5.0 % of a 60.0 ms step)" \
        in format_breakdown(gp)


def test_an_agent_of_a_job_of_several_nodes_says_its_line_is_its_nodes() -> None:
    """An agent sees its own node's events only: its last line must not pass for the job's figure."""
    alone, with_a_peer = GoodputTracker(), GoodputTracker()
    for e in [*start(), ev(12.0, "worker_exit", pid=100, local_rank=0, exitcode=0, signal=None),
              ev(12.5, "agent_exit", exitcode=0)]:
        alone(e)
        with_a_peer({**e, "members": [NODE, "host-2"]} if e["event"] == "round_closed" else e)
    assert alone.summary_line().startswith("goodput ")
    assert with_a_peer.summary_line() == "this node's " + alone.summary_line()
