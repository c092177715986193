"""How a lost node is found out: a killed agent process from its closed liveness link, a stopped
(alive but silent) one from heartbeat silence, and a node that leaves or finishes is no death.

Real agents with real gloo workers on loopback, with the c10d backend and (where an etcd binary
is installed) the etcd backend.  The survivors' ``node_lost`` event names each lost node's cause.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import SCRIPTS, Cluster, base_env, free_port, listening, read_steps, wait_until
from tests.rendezvous.etcd_cluster import EtcdCluster, etcd_available


@dataclass
class Job:
    backend: str
    endpoint: str

    nnodes: str = "1:2"

    def flags(self, log_dir: Path, *extra: str) -> list[str]:
        return [f"--nnodes={self.nnodes}", "--nproc-per-node=1", f"--rdzv-backend={self.backend}",
                f"--rdzv-endpoint={self.endpoint}", "--rdzv-id=deathwatch", "--max-restarts=0",
                f"--log-dir={log_dir}", *extra]


@pytest.fixture(params=["c10d", "etcd"])
def job(request):
    if request.param == "c10d":
        yield Job("c10d", f"127.0.0.1:{free_port()}")
        return
    if not etcd_available():
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with EtcdCluster(1) as cluster:
        yield Job("etcd", cluster.endpoints)


def _events(log_dir: Path, kind: str) -> list[dict]:
    found = []
    for path in log_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line being written
            if event.get("event") == kind:
                found.append(event)
    return found


def _start_pair(agents: Cluster, job: Job, tmp_path: Path, env: dict[str, str], script: list[str] | None = None,
                both: tuple[str, ...] = (), second: tuple[str, ...] = ()):
    """Agent 0 (the c10d store host) then agent 1; returns them with their log directories."""
    logs = [tmp_path / "logs0", tmp_path / "logs1"]
    a0 = agents.start(job.flags(logs[0], *both), script=script, env=env, name="agent0")
    if job.backend == "c10d":
        port = int(job.endpoint.rsplit(":", 1)[1])
        wait_until(lambda: listening(port) or a0.proc.poll() is not None, 30, what="store host up")
    a1 = agents.start(job.flags(logs[1], *both, *second), script=script, env=env, name="agent1")
    return a0, a1, logs


def _steps_env(tmp_path: Path) -> dict[str, str]:
    steps = tmp_path / "steps"
    steps.mkdir()
    return base_env(STEPS_LOG=str(steps), STEPS="100000", STEP_SECONDS="0.05")


def _running_together(agents: Cluster, tmp_path: Path) -> None:
    try:
        wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps") if s.world == 2} == {0, 1}, 90,
                   what="both nodes stepping in one group")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None


def _lost_event(agents: Cluster, log_dir: Path) -> dict:
    try:
        return wait_until(lambda: (_events(log_dir, "node_lost") or [None])[0], 60, what="a node_lost event")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None


def test_killed_agent_is_seen_from_its_closed_link(agents, job, tmp_path):
    a0, a1, logs = _start_pair(agents, job, tmp_path, _steps_env(tmp_path))
    _running_together(agents, tmp_path)
    a1.kill(signal.SIGKILL)
    lost = _lost_event(agents, logs[0])
    [node] = lost["lost"]
    assert f"-{a1.pid}-" in node, lost
    assert lost["causes"] == {node: "link"}, (lost, agents.outputs())
    assert a0.proc.poll() is None, agents.outputs()


def test_two_neighbours_killed_at_once_are_both_seen_from_links(agents, job, tmp_path):
    """Ring 0 → 1 → 2 → 0: node 0 watches 1, whose watcher of 2 dies with it.  Node 0 finds 1 gone,
    moves on to 2 at once and finds it gone too: both from their links, none from silence."""
    job.nnodes = "1:3"
    env = _steps_env(tmp_path)
    a0, a1, logs = _start_pair(agents, job, tmp_path, env)
    logs.append(tmp_path / "logs2")
    a2 = agents.start(job.flags(logs[2]), env=env, name="agent2")
    try:
        wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps") if s.world == 3} == {0, 1, 2}, 90,
                   what="three nodes stepping in one group")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    survivor = next(i for i, d in enumerate(logs) if _events(d, "round_closed")[-1]["group_rank"] == 0)
    victims = [a for i, a in enumerate((a0, a1, a2)) if i != survivor]
    for victim in victims:
        victim.kill(signal.SIGKILL)
    try:
        causes = wait_until(lambda: _lost_causes(logs[survivor], 2), 60, what="both losses")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    assert sorted(causes.values()) == ["link", "link"], (causes, agents.outputs())
    assert {n.split("-")[-2] for n in causes} == {str(v.pid) for v in victims}


def _lost_causes(log_dir: Path, count: int) -> dict[str, str] | None:
    """The causes of the first ``count`` nodes the agent logging to ``log_dir`` reported lost."""
    causes: dict[str, str] = {}
    for event in _events(log_dir, "node_lost"):
        causes.update(event["causes"])
    return causes if len(causes) >= count else None


def test_stopped_agent_is_declared_dead_by_heartbeat_silence(agents, job, tmp_path):
    a0, a1, logs = _start_pair(agents, job, tmp_path, _steps_env(tmp_path))
    _running_together(agents, tmp_path)
    a1.kill(signal.SIGSTOP)  # alive, its sockets open, but silent: only the timeout may declare it
    lost = _lost_event(agents, logs[0])
    [node] = lost["lost"]
    assert f"-{a1.pid}-" in node, lost
    assert lost["causes"] == {node: "silence"}, (lost, agents.outputs())


def test_agent_that_leaves_is_not_a_death(agents, tmp_path):
    job = Job("c10d", f"127.0.0.1:{free_port()}")
    a0, a1, logs = _start_pair(agents, job, tmp_path, _steps_env(tmp_path))
    _running_together(agents, tmp_path)
    a1.kill(signal.SIGTERM)
    lost = _lost_event(agents, logs[0])
    [node] = lost["lost"]
    assert lost["causes"] == {node: "left"}, (lost, agents.outputs())
    assert a1.wait(30) == 128 + signal.SIGTERM


def test_node_that_finishes_first_says_bye(agents, tmp_path):
    """Node 1 finishes while node 0's rank works on: its link closes with a bye, so its watcher
    declares nothing from the link (what the heartbeat path then makes of the departure is its own
    business: with c10d, silence)."""
    job = Job("c10d", f"127.0.0.1:{free_port()}")
    env = base_env(LINGER="8", LINGER_ONCE=str(tmp_path / "lingered"))
    # A long last call: the first round waits for both nodes (later rounds need only node 0).
    a0, a1, logs = _start_pair(agents, job, tmp_path, env, script=[str(SCRIPTS / "finish_uneven.py")],
                               both=("--rdzv-conf=last_call_timeout=120",), second=("--exit-barrier-timeout=1",))
    assert a1.wait(90) == 0, agents.outputs()
    assert a0.wait(90) == 0, agents.outputs()
    causes = [c for e in _events(logs[0], "node_lost") for c in e["causes"].values()]
    assert "link" not in causes, (causes, agents.outputs())
