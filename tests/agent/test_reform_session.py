"""The agent's re-form session alone, with a stand-in control channel: its phases and what it sends.

End-to-end re-forms (real agents, real gloo workers under ``elastrun.train.run``) are in
tests/train/test_reform.py; these check the state machine's rules in milliseconds.
"""

from __future__ import annotations

import pytest

from elastrun.agent.reform_session import COMMIT_WAIT, WORKER_WAIT, Phase, ReformSession
from elastrun.agent.workers.starter import WorkerLaunch
from elastrun.shared.protocol import SOCKET_ENV, WAIT_ENV, Assign, Failed, Pause, Paused, Reformed
from tests.agent.standins import StandInChannel, StandInHandle

pytestmark = pytest.mark.unit


def _handle(local_rank: int, pid: int) -> StandInHandle:
    return StandInHandle(WorkerLaunch(local_rank=local_rank, rank=local_rank, argv=[], env={}, cwd="."), pid)


@pytest.fixture
def handles():
    made = [_handle(0, 100), _handle(1, 101), _handle(2, 102)]
    yield made
    for h in made:
        h.close()


def _reformed(step: int, source: str = "live") -> Reformed:
    return Reformed(round=2, source=source, step=step, took=0.1, after="x")


def test_without_a_channel_nothing_is_paused_and_workers_get_no_socket(handles):
    session = ReformSession(None, timeout=5.0)
    assert session.worker_env() == {}
    assert session.pause(handles, detected_at=0.0) == ([], [])
    assert session.phase is Phase.IDLE and session.pending is None
    assert session.take_kept() == {}
    assert not session.assign(handles[0], {"RANK": "0"}, 2)


def test_workers_get_the_socket_and_the_wait():
    channel = StandInChannel()
    assert ReformSession(channel, 5.0).worker_env() == {SOCKET_ENV: str(channel.path), WAIT_ENV: f"{WORKER_WAIT:g}"}


def test_only_workers_that_answer_paused_are_kept(handles):
    channel = StandInChannel({100: Paused(live=7, pid=100), 101: Failed(error="no"), 102: None})
    session = ReformSession(channel, timeout=5.0)
    kept, asked = session.pause(handles, detected_at=12.5)
    assert kept == [handles[0]] and asked == handles
    assert [m for _, m in channel.sent] == [Pause(), Pause(), Pause()]
    assert session.phase is Phase.PAUSED
    assert session.pending is not None and session.pending.detected_at == 12.5
    assert session.take_kept() == {0: handles[0]}
    assert session.take_kept() == {}  # handed over once


def test_a_join_asks_the_workers_to_leave_at_their_next_commit_and_waits_that_much_longer(handles):
    left = {pid: Paused(live=7, pid=pid, at_commit=True) for pid in (100, 101)}
    channel = StandInChannel({**left, 102: None})
    session = ReformSession(channel, timeout=5.0)
    kept, asked = session.pause(handles, detected_at=1.0, within=COMMIT_WAIT)
    assert [m for _, m in channel.sent] == [Pause(within=COMMIT_WAIT)] * 3
    assert channel.bounds == [5.0 + COMMIT_WAIT]
    assert kept == handles[:2] and session.pending is not None and session.pending.at_commit
    assert f"--reform-timeout (5 s, after {COMMIT_WAIT:g} s to reach its next commit)" in session.refused[102]
    # one kept worker interrupted where it was: the re-form as a whole did not leave at a commit
    channel = StandInChannel({100: Paused(live=7, pid=100, at_commit=True), 101: Paused(live=6, pid=101)})
    session = ReformSession(channel, timeout=5.0)
    session.pause(handles[:2], detected_at=1.0, within=COMMIT_WAIT)
    assert session.pending is not None and not session.pending.at_commit
    session.pause(handles[:2], detected_at=2.0)  # a fault's pause: no time to reach a commit
    assert channel.sent[-1][1] == Pause() and channel.bounds[-1] == 5.0


def test_a_worker_not_connected_is_not_asked(handles):
    channel = StandInChannel({101: Paused(live=None, pid=101)})
    session = ReformSession(channel, timeout=5.0)
    kept, asked = session.pause(handles, detected_at=0.0)
    assert kept == asked == [handles[1]]
    assert [pid for pid, _ in channel.sent] == [101]


def test_a_worker_that_died_after_answering_is_not_kept(handles):
    channel = StandInChannel({100: Paused(live=1, pid=100)})
    handles[0].exit(1)
    session = ReformSession(channel, timeout=5.0)
    assert session.pause(handles, detected_at=0.0) == ([], [])
    assert session.phase is Phase.IDLE


def test_a_full_reform_goes_paused_assigned_idle(handles):
    channel = StandInChannel({100: Paused(live=3, pid=100), 101: Paused(live=3, pid=101)})
    session = ReformSession(channel, timeout=5.0)
    session.pause(handles[:2], detected_at=1.0)
    kept = session.take_kept()
    for local_rank, handle in kept.items():
        assert session.assign(handle, {"RANK": str(local_rank)}, 2)
    session.restarted(2)
    session.assigned(2)
    assert session.phase is Phase.ASSIGNED
    assert (100, Assign(env={"RANK": "0"}, round=2)) in channel.sent
    assert session.pending is not None and session.pending.kept == {0: 100, 1: 101}

    channel.deliver(100, _reformed(3))
    news = session.watch(handles)
    assert news.done is None and session.phase is Phase.ASSIGNED  # rank 1 has not re-formed yet
    channel.deliver(101, Failed(error="RuntimeError: x"))
    channel.deliver(101, _reformed(3, source="memory"))
    news = session.watch(handles)
    assert [(h.pid, f.error) for h, f in news.failed] == [(101, "RuntimeError: x")]
    assert news.done is not None
    assert (news.done.round, news.done.restarted, news.done.sources, news.done.step) == (2, [2], ["live", "memory"], 3)
    assert session.phase is Phase.IDLE and session.pending is None


def test_a_kept_worker_gone_before_its_assignment_is_not_counted(handles):
    channel = StandInChannel({100: Paused(live=3, pid=100), 101: Paused(live=3, pid=101)})
    session = ReformSession(channel, timeout=5.0)
    session.pause(handles[:2], detected_at=1.0)
    kept = session.take_kept()
    kept[1].exit(sig=9)
    assert session.assign(kept[0], {}, 2) and not session.assign(kept[1], {}, 2)
    session.assigned(2)
    assert session.pending is not None and session.pending.kept == {0: 100}


def test_assigned_without_kept_workers_ends_the_reform(handles):
    channel = StandInChannel({100: Paused(live=3, pid=100)})
    session = ReformSession(channel, timeout=5.0)
    session.pause(handles[:1], detected_at=1.0)
    session.take_kept()  # the new round has no place for it
    session.assigned(2)
    assert session.phase is Phase.IDLE and session.pending is None


def test_a_new_change_replaces_the_reform_under_way(handles):
    channel = StandInChannel({100: Paused(live=3, pid=100)})
    session = ReformSession(channel, timeout=5.0)
    session.pause(handles[:1], detected_at=1.0)
    session.assign(session.take_kept()[0], {}, 2)
    session.assigned(2)
    channel.forget(100)  # the kept worker's connection closed: a second change finds no one to pause
    assert session.pause(handles[:1], detected_at=9.0) == ([], [])
    assert session.phase is Phase.IDLE and session.pending is None
    assert session.watch(handles).done is None


def test_forget_and_close_reach_the_channel(handles):
    channel = StandInChannel({100: None})
    session = ReformSession(channel, timeout=5.0)
    session.forget(handles[0])
    session.close()
    assert channel.forgotten == [100] and channel.closed and session.channel is None
