"""The local worker group alone, with a stand-in starter: starts, exits, failures, hangs, kept workers.

The workers are :class:`StandInHandle` objects that a test ends by hand; the heartbeat files, exit
reports and error files are real files, the report a real :class:`AgentReport` whose events the
test reads.  End-to-end behaviour (real agents and workers) is in the other tests of this folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest

from elastrun.agent import group as group_module
from elastrun.agent import silence as silence_module
from elastrun.agent.group import WorkerGroup
from elastrun.agent.group_end import Outcome
from elastrun.agent.reform_session import Phase, ReformSession
from elastrun.agent.report import AgentReport
from elastrun.agent.workers.starter import WorkerLaunch
from elastrun.config import LaunchConfig
from elastrun.shared.protocol import HEARTBEAT_ENV, Assign, Paused, Reformed, exit_report_path
from tests.agent.standins import StandInChannel, StandInStarter, round_result

pytestmark = pytest.mark.unit


class Setup:
    def __init__(self, tmp_path, channel: StandInChannel | None = None, **config) -> None:
        self.tmp = tmp_path
        self.config = LaunchConfig(entrypoint="train.py", **{"nproc_per_node": 2, **config})
        self.report = AgentReport(self.config, "node-a", "host-a")
        self.events: list[dict] = []
        self.report.events.add_listener(self.events.append)
        self.starter = StandInStarter()
        self.session = ReformSession(channel, timeout=5.0)
        #: The hangs claimed in the rendezvous (a stand-in: :attr:`first_fault` answers every claim).
        self.claims: list = []
        self.first_fault: str | None = None
        self.group = WorkerGroup(self.config, self.starter, self.session, self.report, "node-a", "host-a",
                                 self._claim)

    def _claim(self, failure) -> str | None:
        self.claims.append(failure)
        return self.first_fault

    def beat(self, launches: list[WorkerLaunch], silent: dict[int, float]) -> None:
        """Every worker has beaten; those of ``silent`` local ranks last that many seconds ago."""
        for launch in launches:
            with open(launch.env[HEARTBEAT_ENV], "w") as fh:
                fh.write("1\n")
            if launch.local_rank in silent:
                ago = time.time() - silent[launch.local_rank]
                os.utime(launch.env[HEARTBEAT_ENV], (ago, ago))

    def launches(self, result) -> list[WorkerLaunch]:
        out = []
        for local_rank in range(self.config.nproc_per_node):
            rank = result.rank_offset + local_rank
            base = self.tmp / f"attempt_{result.generation}" / f"rank_{rank}"
            out.append(WorkerLaunch(local_rank=local_rank, rank=rank, argv=["train.py"], cwd=str(self.tmp),
                                    env={HEARTBEAT_ENV: str(self.tmp / f"hb_{rank}"), "RANK": str(rank),
                                         "TORCHELASTIC_ERROR_FILE": str(base / "error.json")},
                                    console_prefix=f"[node0 rank{rank}]: ", error_file=base / "error.json"))
        return out

    def named(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]

    def close(self) -> None:
        self.group.kill()
        self.report.close()


@pytest.fixture
def setup(tmp_path):
    made: list[Setup] = []

    def make(channel: StandInChannel | None = None, **config) -> Setup:
        made.append(Setup(tmp_path, channel, **config))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_group_succeeds_when_every_worker_exits_0(setup):
    s = setup()
    result = round_result()
    s.group.start(result, s.launches(result))
    assert [(e["rank"], e["start_method"]) for e in s.named("worker_start")] == [(0, "stand-in"), (1, "stand-in")]
    assert s.group.check(result) is None
    assert len(s.group.filenos()) == 2
    s.starter.started[0].exit(0)
    assert s.group.check(result) is None and len(s.group.filenos()) == 1
    s.starter.started[1].exit(0)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.SUCCEEDED
    assert [(e["rank"], e["exitcode"]) for e in s.named("worker_exit")] == [(0, 0), (1, 0)]


def test_a_failure_kills_the_others_and_names_the_root_cause(setup):
    s = setup()
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    launches[1].error_file.parent.mkdir(parents=True)
    launches[1].error_file.write_text(json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback ...\nValueError: bad batch", "timestamp": "1"}}}))
    s.starter.started[1].exit(3)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the failure of rank 1"
    assert end.failure is not None and (end.failure.rank, end.failure.exitcode) == (1, 3)
    assert end.failure.message.endswith("ValueError: bad batch") and end.failure.node_id == "node-a"
    assert signal.SIGKILL in s.starter.started[0].signals  # no re-forms: the survivor is killed
    assert s.named("worker_failure")[0]["rank"] == 1


def test_a_peers_connection_error_seen_first_is_not_the_failure_recorded(setup):
    """Rank 1 SIGKILLed and rank 0 failed on the closed connection, both found in one look: rank 0,
    polled first, has the earlier time, but its error is about its peer (docs/failures.md)."""
    s = setup()
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    launches[0].error_file.parent.mkdir(parents=True)
    launches[0].error_file.write_text(json.dumps({"message": {"message": "RuntimeError: ...", "extraInfo": {
        "py_callstack": "Traceback ...\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:6048",
        "timestamp": "1"}}}))
    s.starter.started[0].exit(1)
    s.starter.started[1].exit(sig=signal.SIGKILL)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the failure of rank 1"
    assert end.failure is not None and (end.failure.rank, end.failure.signal, end.failure.peer_error) == (
        1, "SIGKILL", False)
    assert [(e["rank"], e["peer_error"]) for e in s.named("worker_failure")] == [(1, False)]


def test_a_worker_found_dead_as_the_group_ends_for_another_node_has_its_exit_recorded(setup):
    """Rank 1 is SIGKILLed, and before this node looks at it again the rendezvous says another node
    asked for a new round (its worker failed on the closed connection): the group ends, and rank 1's
    exit is in the event log all the same (it was missing, and goodput then knew the fault only from
    the peer it cut off), with no failure recorded for it here."""
    s = setup()
    result = round_result()
    s.group.start(result, s.launches(result))
    assert s.group.check(result) is None  # both seen running
    s.starter.started[1].exit(sig=signal.SIGKILL)
    s.group.end(set(), time.monotonic(), dump=True)  # what the agent does for another node's new round
    exits = s.named("worker_exit")
    assert [(e["rank"], e["signal"]) for e in exits] == [(1, "SIGKILL")], exits
    assert exits[0]["alive_at"] is not None and not s.named("worker_failure")
    assert signal.SIGKILL not in s.starter.started[1].signals  # dead already: nothing sent to it


def test_a_worker_on_its_way_out_is_not_seen_running(setup):
    """A worker with a SIGKILL pending (or torn down by the kernel), not yet reaped, is still the group's
    and still running as far as its handle can tell; it is not counted as seen running: its exit's
    ``alive_at`` is the look before the kill, which goodput takes as the earliest moment of the crash.
    Its low-priority threads are raised, once, so that it ends now (``hasten_exit``)."""
    s = setup()
    result = round_result()
    s.group.start(result, s.launches(result))
    assert s.group.check(result) is None  # both seen running
    time.sleep(0.01)  # alive_at is logged to 0.1 ms
    before = time.time()
    s.starter.started[1].is_dying = True
    assert s.group.check(result) is None  # not reaped yet: the group runs on
    assert s.group.check(result) is None
    assert [h.hastened for h in s.starter.started] == [0, 1]  # its end hastened, once
    s.starter.started[1].exit(sig=signal.SIGKILL)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED
    [exit_] = [e for e in s.named("worker_exit") if e["rank"] == 1]
    assert exit_["alive_at"] is not None and exit_["alive_at"] < before, (exit_, before)


def test_a_death_after_the_script_returned_is_a_teardown_fault_not_a_failure(setup):
    s = setup(nproc_per_node=1)
    result = round_result(nproc=1)
    launches = s.launches(result)
    s.group.start(result, launches)
    with open(exit_report_path(launches[0].env[HEARTBEAT_ENV]), "w") as fh:
        fh.write("0\n")
    s.starter.started[0].exit(sig=signal.SIGABRT)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.SUCCEEDED
    fault = s.named("teardown_fault")[0]
    assert (fault["exitcode"], fault["fault"]) == (0, "killed by SIGABRT")


def test_a_silent_worker_is_dumped_and_the_group_ends(setup):
    """A running silent worker is sent SIGABRT at once, before the others are paused: its stacks show
    where it hangs, not where it went once its peers left."""
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.5)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    hung, other = s.starter.started
    channel.answers[other.pid] = Paused(live=3, pid=other.pid)
    order = record_order(channel, hung)
    s.beat(launches, {0: 5})
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the hang of rank 0"
    assert end.failure is not None and end.failure.message.startswith("hang detected: no heartbeat for")
    assert s.starter.started[0].signals[:2] == [signal.SIGABRT, signal.SIGCONT]
    assert order[:3] == ["SIGABRT", "SIGCONT", f"Pause to {other.pid}"], order  # a running one is not cut off
    assert other.poll() is None and not other.signals  # paused and kept
    assert s.named("hang_detected")[0]["rank"] == 0
    assert [c.rank for c in s.claims] == [0]  # claimed in the rendezvous before it was acted on
    assert {e["rank"] for e in s.named("worker_stepping")} == {0, 1}  # both first beats were seen


def record_order(channel: StandInChannel, handle) -> list[str]:
    """What the group sends, in order: the channel's messages, and the signals ``handle`` gets."""
    order: list[str] = []
    send, send_signal, cut_off = channel.send, handle.send_signal, handle.cut_off

    def sent(pid, message):
        order.append(f"{type(message).__name__} to {pid}")
        return send(pid, message)

    def signalled(sig):
        order.append(signal.Signals(sig).name)
        send_signal(sig)

    def cut():
        order.append("cut off")
        return cut_off()

    channel.send, handle.send_signal, handle.cut_off = sent, signalled, cut
    return order


def test_of_two_silent_workers_the_frozen_one_is_the_hang_and_the_other_keeps_its_process(setup):
    """Rank 1 is frozen (stopped); rank 0, silent longer, is blocked on it: rank 1 is dumped and killed,
    rank 0 is paused and kept, and only rank 1 is blamed.  Rank 1 is cut off its peers at once, and let
    run for its dump (SIGCONT) only once rank 0 has left the group: resumed earlier, its collectives
    would go on with rank 0 as it left."""
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.5)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    blocked, hung = s.starter.started
    hung.is_frozen = True
    channel.answers[blocked.pid] = Paused(live=3, pid=blocked.pid)
    order = record_order(channel, hung)
    s.beat(launches, {0: 6, 1: 5})
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the hang of rank 1"
    assert hung.signals[:2] == [signal.SIGABRT, signal.SIGCONT] and hung.poll() is not None
    assert order[:4] == ["cut off", f"Pause to {blocked.pid}", "SIGABRT", "SIGCONT"], order
    assert blocked.poll() is None and signal.SIGABRT not in blocked.signals
    assert [e["rank"] for e in s.named("hang_detected")] == [1]
    assert s.session.phase is Phase.PAUSED


def test_a_peer_silent_first_is_not_blamed_while_the_frozen_worker_it_waits_on_is_not_yet_silent(
        setup, monkeypatch):
    """The race of two ranks that beat a moment apart: rank 1 beat last and was then stopped, so rank 0,
    blocked on it, passes its hang timeout first.  A check in between waits (the frozen rank 1 is not
    silent long enough yet) instead of blaming rank 0, however long (no grace bounds it: a frozen rank's
    beats cannot advance); once rank 1 is silent too it is the hang, and rank 0 keeps its process."""
    monkeypatch.setattr(silence_module, "HANG_GRACE", 0.0)
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.5)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    blocked, hung = s.starter.started
    hung.is_frozen = True
    channel.answers[blocked.pid] = Paused(live=3, pid=blocked.pid)
    s.beat(launches, {0: 0.6, 1: 0.0})
    assert s.group.check(result) is None and s.claims == []
    s.beat(launches, {0: 3.0, 1: 0.3})  # rank 1 still within its timeout, rank 0 silent for long
    assert s.group.check(result) is None and s.claims == []
    s.beat(launches, {0: 0.7, 1: 0.6})
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the hang of rank 1"
    assert [c.rank for c in s.claims] == [1] and [e["rank"] for e in s.named("hang_detected")] == [1]
    assert blocked.poll() is None and signal.SIGABRT not in blocked.signals


def test_a_silent_worker_is_blamed_at_once_when_its_peer_beats_and_runs(setup):
    """Without a frozen peer (one node), a lone silent worker waits no grace."""
    s = setup(hang_timeout=0.5)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    s.beat(launches, {0: 0.6})
    end = s.group.check(result)
    assert end is not None and end.reason == "the hang of rank 0"


def test_a_killed_worker_counts_dead_before_its_reaping_and_a_later_look_reaps_it(setup, monkeypatch):
    """SIGKILLed, not yet reaped after KILLED_REAP_WAIT (its idle-priority thread waits for a core): its death is
    recorded as a SIGKILL, the group ends without waiting for its end (the survivor is paused), and a later look
    reaps it."""
    channel = StandInChannel()
    s = setup(channel)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    survivor, killed = s.starter.started
    channel.answers[survivor.pid] = Paused(live=3, pid=survivor.pid)
    s.group.act_on_kill = True  # a host without GPUs (this one's answer, whatever the test machine has)
    killed.is_dying = killed.is_killed = killed.outlives_kill = True
    assert s.group.check(result) is None  # a death normally ends within KILLED_REAP_WAIT: counted at the reaping
    monkeypatch.setattr(group_module, "KILLED_REAP_WAIT", 0.0)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the failure of rank 1"
    assert end.failure is not None and end.failure.signal == "SIGKILL"
    assert [(e["rank"], e["signal"]) for e in s.named("worker_exit")] == [(1, "SIGKILL")]
    assert killed.hastened == 1 and killed.poll() is None and not killed.closed and killed in s.group.late
    assert survivor.poll() is None and s.session.phase is Phase.PAUSED
    killed.exit(sig=signal.SIGKILL)  # its last thread ended
    second = round_result(round_=2, generation=1)
    s.group.start(second, s.launches(second))
    assert s.group.check(second) is None
    assert killed.closed and len(s.group.late) == 0


def test_on_a_host_with_gpus_a_killed_worker_counts_dead_only_once_reaped(setup):
    """Its context still holds the card's memory until the kernel releases it, just before the reaping."""
    s = setup()
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    _, killed = s.starter.started
    s.group.act_on_kill = False
    killed.is_dying = killed.is_killed = killed.outlives_kill = True
    assert s.group.check(result) is None and s.named("worker_exit") == []
    killed.exit(sig=signal.SIGKILL)
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.failure.signal == "SIGKILL"
    assert len(s.group.late) == 0


def test_a_running_silent_worker_of_a_larger_round_waits_on_the_fault_claimed_first(setup, monkeypatch):
    """Its node waits out the grace (a frozen worker's node claims first), then finds another node's
    hang claimed: nobody here is blamed, the group ends as for a change elsewhere, the worker is paused."""
    grace = 0.2
    monkeypatch.setattr(silence_module, "HANG_GRACE", grace)
    channel = StandInChannel()
    s = setup(channel, hang_timeout=0.5, nproc_per_node=1)
    result = dataclasses.replace(round_result(nproc=1, world=2), group_world_size=2)
    launches = s.launches(result)
    s.group.start(result, launches)
    [blocked] = s.starter.started
    channel.answers[blocked.pid] = Paused(live=3, pid=blocked.pid)
    s.beat(launches, {0: 5})
    s.first_fault = "the hang of rank 1 on host-b"
    found = time.monotonic()
    assert s.group.check(result) is None and s.claims == []  # within the grace
    while (end := s.group.check(result)) is None:
        assert time.monotonic() - found < 10 * grace
        time.sleep(0.02)
    assert time.monotonic() - found >= grace
    assert end.outcome is Outcome.MEMBERSHIP and end.failure is None
    assert end.reason == "rank 0 waits on the hang of rank 1 on host-b"
    assert s.named("hang_detected") == [] and s.named("restart")[0]["reason"] == end.reason
    assert blocked.poll() is None and signal.SIGABRT not in blocked.signals
    assert s.session.phase is Phase.PAUSED


def test_a_frozen_worker_of_a_larger_round_is_claimed_at_once(setup):
    s = setup(hang_timeout=0.5, nproc_per_node=1)
    result = dataclasses.replace(round_result(nproc=1, world=2), group_world_size=2)
    launches = s.launches(result)
    s.group.start(result, launches)
    s.starter.started[0].is_frozen = True
    s.beat(launches, {0: 5})
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the hang of rank 0"
    assert [c.rank for c in s.claims] == [0]


def test_survivors_are_paused_kept_and_handed_the_next_round(setup):
    channel = StandInChannel()
    s = setup(channel)
    first = round_result(round_=1)
    s.group.start(first, s.launches(first))
    survivor, failing = s.starter.started
    channel.answers[survivor.pid] = Paused(live=4, pid=survivor.pid)
    failing.exit(1)
    end = s.group.check(first)
    assert end is not None and end.outcome is Outcome.FAILED
    assert survivor.poll() is None and signal.SIGKILL not in survivor.signals
    assert s.session.phase is Phase.PAUSED

    second = round_result(round_=2, generation=1, offset=2, world=4)
    s.group.start(second, s.launches(second))
    assert len(s.starter.started) == 3  # only the failed rank was started anew
    assert [(e["rank"], e["start_method"]) for e in s.named("worker_start")][2:] == [(2, "kept"), (3, "stand-in")]
    pid, assign = channel.sent[-1]
    assert pid == survivor.pid and isinstance(assign, Assign) and assign.round == 2
    assert survivor.launch.env["TORCHELASTIC_ERROR_FILE"].endswith("attempt_0/rank_0/error.json")
    assert survivor.prefix == "[node0 rank2]: " and survivor.launch.rank == 2
    assert s.session.phase is Phase.ASSIGNED

    channel.deliver(survivor.pid, Reformed(round=2, source="live", step=4, took=0.2, after="x"))
    assert s.group.check(second) is None
    reform = s.named("reform")[0]
    assert (reform["kept"], reform["restarted"], reform["sources"], reform["step"]) == ([0], [1], ["live"], 4)
    assert s.session.phase is Phase.IDLE


def test_forward_signal_then_kill(setup):
    s = setup()
    result = round_result()
    s.group.start(result, s.launches(result))
    s.group.forward_signal(signal.SIGTERM, grace=0.0)
    for handle in s.starter.started:
        assert handle.signals[0] == signal.SIGTERM and handle.poll() is not None and handle.closed


def test_a_frozen_worker_behind_another_fault_is_replaced_at_once_and_not_blamed(setup):
    """Another node's fault was claimed first (a frozen worker lost the claim): the frozen worker
    cannot answer a pause, so it is dumped and killed at once, without a failure charged here."""
    s = setup(StandInChannel(), hang_timeout=0.5, nproc_per_node=1)
    result = dataclasses.replace(round_result(nproc=1, world=2), group_world_size=2)
    launches = s.launches(result)
    s.group.start(result, launches)
    [frozen] = s.starter.started
    frozen.is_frozen = True
    s.beat(launches, {0: 5})
    s.first_fault = "the loss of node node-b"
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.MEMBERSHIP and end.failure is None
    assert frozen.signals[:2] == [signal.SIGABRT, signal.SIGCONT] and frozen.poll() is not None
    assert s.named("hang_detected") == [] and s.session.take_kept() == {}
