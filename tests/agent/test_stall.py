"""Stalls before a worker's first heartbeat: the learned start-up bound, its verdict and its report.

The bound and the descriptions are pure functions; the group's part runs with stand-in workers
(real heartbeat and step-log files).  The end-to-end check, a worker blocked in its restore after a
re-form, is ``tests/train/test_stall.py``.
"""

from __future__ import annotations

import os
import time

import pytest

from elastrun.agent import hang, stall
from elastrun.agent.group_end import Outcome
from elastrun.agent.hang import HangTracker, StartupHistory, startup_bound
from elastrun.shared import steplog
from elastrun.shared.protocol import HEARTBEAT_ENV, Paused, Reformed
from tests.agent.standins import StandInChannel, round_result
from tests.agent.test_group import setup  # noqa: F401 - the fixture

pytestmark = pytest.mark.unit


def test_the_start_up_bound_is_learned_from_the_slowest_start_with_a_floor_and_backs_off():
    assert startup_bound(None, None, 0) is None  # no worker ever sent a heartbeat: no bound
    assert startup_bound(None, 2.0, 0) == hang.STARTUP_FLOOR  # 5 x 2 s is under the floor
    assert startup_bound(None, 10.0, 0) == 50.0
    assert startup_bound(None, 10.0, 1) == 100.0 and startup_bound(None, 10.0, 2) == 200.0
    assert startup_bound(None, 10.0, 99) == 50.0 * 2**hang.STARTUP_DOUBLINGS
    assert startup_bound(None, 0.3, 0, floor=3.0) == 3.0
    assert startup_bound(7.0, 10.0, 3) == 7.0  # --startup-timeout wins


def test_the_history_learns_each_first_heartbeat_and_says_how_the_bound_is_made():
    h = StartupHistory(None, hang_timeout=None)
    assert h.bound() is None and not h.heartbeats
    assert h.describe() == "no bound: no worker of this node has sent a heartbeat"
    h.stepped(1.5)
    h.stepped(8.0)
    h.stepped(3.0)
    assert (h.count, h.longest, h.bound()) == (3, 8.0, 40.0) and h.heartbeats
    assert h.describe() == ("40 s, learned: 5 x the slowest of 3 start(s) on this node (8.0 s to the first "
                            "heartbeat), at least 30 s")
    h.stalled()
    assert h.bound() == 80.0 and h.describe().endswith("doubled 1 time(s) after start-up stalls")
    h.stepped(1.0)  # a worker reached its first heartbeat: the back-off ends
    assert h.bound() == 40.0
    assert StartupHistory(12.0).describe() == "--startup-timeout 12 s"


def test_a_worker_silent_past_its_start_up_bound_is_judged_and_made_no_progress(tmp_path):
    path = str(tmp_path / "hb")
    t = HangTracker(path, None, 5.0, "5 s, learned", expects_beats=True)
    assert t.check(t.started + 4.0) is None
    reason = t.check(t.started + 6.0)
    assert reason == "no first heartbeat 6.0 s after its start (start-up bound 5 s, learned)"
    assert t.stalled_at_startup and not t.made_progress(t.started + 1000)
    # A plain script (no heartbeats in the job, no bound): never judged, and a long run is progress.
    plain = HangTracker(path, None, None)
    assert plain.check(plain.started + 1000) is None and plain.made_progress(plain.started + 61)
    # In a job that sends heartbeats, running long without two of them is no progress.
    assert not HangTracker(path, None, None, expects_beats=True).made_progress(time.time() + 1000)


def test_the_newest_step_record_is_found_and_described(tmp_path, monkeypatch):
    path = tmp_path / "steps-1.bin"
    assert steplog.last(path) is None
    monkeypatch.setenv("ELASTRUN_ROUND", "4")
    log = steplog.StepLog(path)
    assert steplog.last(path) is None  # a header and no record
    log.restored(time.time() - 0.5, 812, "memory")
    for step in range(813, 820):
        log.step(step, time.time())
    rec = steplog.last(path)
    assert rec is not None and (rec.kind, rec.step, rec.round) == (steplog.STEP, 819, 4)
    assert stall.describe_record(rec, rec.t2 + 30, 4) == "committed step 819 in this round, 30.0 s ago"
    log.restored(time.time() - 0.25, 819, "peer")
    log.close()
    rec = steplog.last(path)
    assert rec is not None
    text = stall.describe_record(rec, rec.t1 + 2, 5)
    assert text is not None and text.startswith("restored step 819 from peer in round 4, 2.0 s ago (took 0.2")
    assert stall.last_record({}, None, 1, time.time(), 4) is None  # no error file, no step log named


def test_each_worker_state_says_where_the_worker_most_likely_is():
    kept = stall.WorkerState(rank=2, local_rank=0, pid=11, entered="kept", since_start=31.0, beats=0,
                             last_beat_ago=None, record="committed step 900 in round 7, 32.0 s ago")
    assert kept.doing() == "not re-formed yet: in its new process group's set-up or its restore"
    assert kept.line() == ("rank 2 (pid 11): kept through a re-form, assigned 31.0 s ago; no heartbeat in this "
                           "round; last step record: committed step 900 in round 7, 32.0 s ago; not re-formed yet: "
                           "in its new process group's set-up or its restore")
    kept.reformed = ("memory", 900)
    assert kept.doing() == "re-formed, before its first heartbeat (its first step)"
    fresh = stall.WorkerState(rank=3, local_rank=1, pid=12, entered="fork-pool", since_start=5.0, beats=4,
                              last_beat_ago=0.2)
    assert fresh.doing() == "stepping" and "last step record: none" in fresh.line()
    assert fresh.as_event()["doing"] == "stepping"


def _first_beat(launch, at: float) -> None:
    with open(launch.env[HEARTBEAT_ENV], "w") as fh:
        fh.write(f"{1:>12d} {at:.3f}\n")


def test_a_group_that_never_steps_after_a_re_form_is_judged_by_the_learned_bound(setup):  # noqa: F811
    """Round 1 steps (the bound is learned from its first heartbeats); in round 2 the kept worker is
    assigned but never re-forms and the new one never beats: past the bound, the group says what each
    was doing, asks both for their stacks, and ends as for a hang of the worker that is silent longest."""
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.3)
    first = round_result()
    launches = s.launches(first)
    s.group.start(first, launches)
    for launch in launches:
        _first_beat(launch, time.time())
    assert s.group.check(first) is None
    assert s.group.history.count == 2 and s.group.history.bound() == pytest.approx(0.3, abs=0.05)
    kept, gone = s.starter.started
    channel.answers[kept.pid] = Paused(live=5, pid=kept.pid)
    s.group.end({1}, time.monotonic())  # local rank 1 failed: rank 0 is kept for round 2
    second = round_result(round_=2, generation=1)
    launches = s.launches(second)
    for launch in launches:
        os.unlink(launch.env[HEARTBEAT_ENV])
    s.group.start(second, launches)
    assert s.group.check(second) is None  # within the bound
    deadline = time.monotonic() + 10
    while (end := s.group.check(second)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert end.outcome is Outcome.FAILED and end.failure is not None
    assert end.failure.message.startswith("hang detected: no first heartbeat ")
    assert "start-up bound 0.3 s, learned: 5 x the slowest of 2 start(s)" in end.failure.message
    assert not end.failure.progress  # said as a stall, not taken for progress by its running time
    [report] = s.named("stall")
    assert report["round"] == 2 and report["reason"].startswith("no first heartbeat")
    doing = {w["rank"]: (w["entered"], w["doing"]) for w in report["workers"]}
    assert doing == {0: ("kept", "not re-formed yet: in its new process group's set-up or its restore"),
                     1: ("stand-in", "before its first heartbeat (its process group's set-up, its restore or "
                                     "its first step)")}
    culprit = s.starter.started[0] if end.failure.rank == 0 else s.starter.started[2]
    other = s.starter.started[2] if culprit is s.starter.started[0] else s.starter.started[0]
    assert report["stacks"] == [other.launch.rank] and other.dumps == 1  # the culprit dumps through SIGABRT
    assert s.group.history.stalls == 1 and s.group.history.bound() == pytest.approx(0.6, abs=0.1)
    assert gone.poll() is not None


def test_a_re_formed_worker_is_reported_as_re_formed(setup):  # noqa: F811
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.3, nproc_per_node=1)
    first = round_result(nproc=1)
    launches = s.launches(first)
    s.group.start(first, launches)
    _first_beat(launches[0], time.time())
    assert s.group.check(first) is None
    [kept] = s.starter.started
    channel.answers[kept.pid] = Paused(live=5, pid=kept.pid)
    s.group.end(set(), time.monotonic())
    second = round_result(round_=2, generation=1, nproc=1)
    launches = s.launches(second)
    os.unlink(launches[0].env[HEARTBEAT_ENV])
    s.group.start(second, launches)
    channel.deliver(kept.pid, Reformed(round=2, source="live", step=5, took=0.1))
    deadline = time.monotonic() + 10
    while s.group.check(second) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    [report] = s.named("stall")
    assert report["workers"][0]["reformed"] == ["live", 5]
    assert report["workers"][0]["doing"] == "re-formed, before its first heartbeat (its first step)"
