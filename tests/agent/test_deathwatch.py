"""How a lost node is found out: a killed agent process from its closed liveness link, a stopped
(alive but silent) one from heartbeat silence, and a node that leaves or finishes is no death.

Real agents with real gloo workers on loopback, with the c10d backend and (where an etcd binary
is installed) the etcd backend.  The survivors' ``node_lost`` event names each lost node's cause.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.agent.jobs import Job, events, start_pair, steps_env
from tests.harness import SCRIPTS, Cluster, base_env, free_port, read_steps, wait_until

pytestmark = pytest.mark.e2e


def _running_together(agents: Cluster, tmp_path: Path) -> None:
    try:
        wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps") if s.world == 2} == {0, 1}, 90,
                   what="both nodes stepping in one group")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None


def _lost_event(agents: Cluster, log_dir: Path) -> dict:
    try:
        return wait_until(lambda: (events(log_dir, "node_lost") or [None])[0], 60, what="a node_lost event")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None


#: This asks that the link name the cause ("link"), not only that the node be found lost: the link's verdict must
#: come before the survivor's worker fails on the broken collective and its agent closes a round without the killed
#: nodes.  It once had to run alone: under load a SIGKILLed agent lingered 10-13 s (its idle-priority copy thread got
#: no CPU to tear the process down), so its sockets stayed open and the loss was named "silence".  Since no such
#: thread is parked (docs/benchmarks.md, "An agent's death on a busy host") it runs with the rest: 81 of 81 runs of
#: the link and deathwatch tests passed beside a full suite run (2026-11-27, 2 cores).
def test_killed_agents_are_seen_from_their_closed_links(agents, job, tmp_path):
    """Ring 0 → 1 → 2 → 0: one node survives and the two others are SIGKILLed at once.  The survivor
    finds the node it watches gone from its closed link, moves on to the next at once (whose watcher
    died with the first) and finds it gone too: both from their links, none from silence, each named
    by its agent's PID; the survivor's agent goes on.  (One killed neighbour is the first half of
    this: it once had a test of its own, two more agents per backend.)"""
    job.nnodes = "1:3"
    env = steps_env(tmp_path)
    a0, a1, logs = start_pair(agents, job, tmp_path, env)
    logs.append(tmp_path / "logs2")
    a2 = agents.start(job.flags(logs[2]), env=env, name="agent2")
    try:
        wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps") if s.world == 3} == {0, 1, 2}, 90,
                   what="three nodes stepping in one group")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    survivor = next(i for i, d in enumerate(logs) if events(d, "round_closed")[-1]["group_rank"] == 0)
    nodes = (a0, a1, a2)
    victims = [a for i, a in enumerate(nodes) if i != survivor]
    for victim in victims:
        victim.kill(signal.SIGKILL)
    try:
        causes = wait_until(lambda: _lost_causes(logs[survivor], 2), 60, what="both losses")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    assert sorted(causes.values()) == ["link", "link"], (causes, agents.outputs())
    assert {n.split("-")[-2] for n in causes} == {str(v.pid) for v in victims}
    assert nodes[survivor].proc.poll() is None, agents.outputs()


def _lost_causes(log_dir: Path, count: int) -> dict[str, str] | None:
    """The causes of the first ``count`` nodes the agent logging to ``log_dir`` reported lost."""
    causes: dict[str, str] = {}
    for event in events(log_dir, "node_lost"):
        causes.update(event["causes"])
    return causes if len(causes) >= count else None


def test_stopped_agent_is_declared_dead_by_heartbeat_silence(agents, job, tmp_path):
    a0, a1, logs = start_pair(agents, job, tmp_path, steps_env(tmp_path))
    _running_together(agents, tmp_path)
    a1.kill(signal.SIGSTOP)  # alive, its sockets open, but silent: only the timeout may declare it
    lost = _lost_event(agents, logs[0])
    [node] = lost["lost"]
    assert f"-{a1.pid}-" in node, lost
    assert lost["causes"] == {node: "silence"}, (lost, agents.outputs())


def test_agent_that_leaves_is_not_a_death(agents, tmp_path):
    job = Job("c10d", f"127.0.0.1:{free_port()}")
    a0, a1, logs = start_pair(agents, job, tmp_path, steps_env(tmp_path))
    _running_together(agents, tmp_path)
    a1.kill(signal.SIGTERM)
    lost = _lost_event(agents, logs[0])
    [node] = lost["lost"]
    assert lost["causes"] == {node: "left"}, (lost, agents.outputs())
    assert a1.wait(30) == 128 + signal.SIGTERM


def test_node_that_finishes_first_says_bye(agents, tmp_path):
    """Node 1 finishes while node 0's rank works on: its link closes with a bye, and its `done:`
    mark tells the heartbeat path that its silence is no loss: node 0's worker is never restarted."""
    job = Job("c10d", f"127.0.0.1:{free_port()}")
    env = base_env(LINGER="8", LINGER_ONCE=str(tmp_path / "lingered"))
    # A long last call: the first round waits for both nodes (later rounds need only node 0).
    a0, a1, logs = start_pair(agents, job, tmp_path, env, script=[str(SCRIPTS / "finish_uneven.py")],
                               both=("--rdzv-conf=last_call_timeout=120",), second=("--exit-barrier-timeout=1",))
    assert a1.wait(90) == 0, agents.outputs()
    assert a0.wait(90) == 0, agents.outputs()
    assert events(logs[0], "node_lost") == [], agents.outputs()
    assert len(events(logs[0], "worker_start")) == 1, agents.outputs()
