"""The local worker group alone, with a stand-in starter: starts, exits, failures, hangs, kept workers.

The workers are :class:`StandInHandle` objects that a test ends by hand; the heartbeat files, exit
reports and error files are real files, the report a real :class:`AgentReport` whose events the
test reads.  End-to-end behaviour (real agents and workers) is in the other tests of this folder.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from elastrun.agent.group import Outcome, WorkerGroup
from elastrun.agent.reform import Phase, ReformSession
from elastrun.agent.report import AgentReport
from elastrun.config import LaunchConfig
from elastrun.protocol import HEARTBEAT_ENV, Assign, Paused, Reformed, exit_report_path
from elastrun.workers.api import WorkerLaunch
from tests.agent.standins import StandInChannel, StandInStarter, round_result


class Setup:
    def __init__(self, tmp_path, channel: StandInChannel | None = None, **config) -> None:
        self.tmp = tmp_path
        self.config = LaunchConfig(entrypoint="train.py", **{"nproc_per_node": 2, **config})
        self.report = AgentReport(self.config, "node-a", "host-a")
        self.events: list[dict] = []
        self.report.events.add_listener(self.events.append)
        self.starter = StandInStarter()
        self.session = ReformSession(channel, timeout=5.0)
        self.group = WorkerGroup(self.config, self.starter, self.session, self.report, "node-a", "host-a")

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
    s = setup(hang_timeout=0.5)
    result = round_result()
    launches = s.launches(result)
    s.group.start(result, launches)
    for launch in launches:
        with open(launch.env[HEARTBEAT_ENV], "w") as fh:
            fh.write("1\n")
    os.utime(launches[0].env[HEARTBEAT_ENV], (time.time() - 5, time.time() - 5))
    end = s.group.check(result)
    assert end is not None and end.outcome is Outcome.FAILED and end.reason == "the hang of rank 0"
    assert end.failure is not None and end.failure.message.startswith("hang detected: no heartbeat for")
    assert s.starter.started[0].signals[:2] == [signal.SIGABRT, signal.SIGCONT]
    assert signal.SIGKILL in s.starter.started[1].signals
    assert s.named("hang_detected")[0]["rank"] == 0
    assert {e["rank"] for e in s.named("worker_stepping")} == {0}  # rank 0's first beat was seen before


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
