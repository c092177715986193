"""Nodes lost and nodes joining: several agents on loopback with the c10d backend."""

import os
import signal
import time

import pytest

from elastrun.observe.status_view import read_status
from elastrun.rendezvous.api import RendezvousParameters
from tests.agent.jobs import events, start_pair, steps_env
from tests.harness import alive, base_env, free_port, listening, read_steps, wait_until

pytestmark = pytest.mark.e2e


def _flags(port: int, nnodes: str, run_id: str) -> list[str]:
    return [f"--nnodes={nnodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", "--max-restarts=0"]


def _start_host_first(agents, flags, env, count):
    """Start ``count`` agents; the first binds the store before the others start."""
    started = [agents.start(flags, env=env, name="agent0")]
    port = int(next(f for f in flags if f.startswith("--rdzv-endpoint")).rsplit(":", 1)[1])
    wait_until(lambda: "round" in started[0].output() or listening(port), 30, what="store host up")
    for i in range(1, count):
        started.append(agents.start(flags, env=env, name=f"agent{i}"))
    return started


def _three_stepping(steps_dir, three) -> None:
    """Until ranks 0, 1 and 2 step in one group of three, or one of the ``three`` agents exits."""
    wait_until(lambda: {s.rank for s in read_steps(steps_dir) if s.world == 3} == {0, 1, 2}
               or any(a.proc.poll() is not None for a in three), 90, what="three nodes stepping")


def test_three_nodes_lose_one_and_continue(agents, tmp_path):
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    flags = _flags(free_port(), "1:3", "lose-one")
    a0, a1, a2 = _start_host_first(agents, flags, env, 3)
    try:
        wait_until(lambda: any(s.world == 3 for s in read_steps(steps_dir)), 90, what="steps at world 3")
    except AssertionError as exc:  # keep the agents' own account (seen once in a loaded CI run)
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    victim_workers = a2.descendants()
    assert victim_workers
    killed_at = time.time()
    a2.kill(signal.SIGKILL)
    # Its worker dies with it (parent-death signal): no orphan.
    wait_until(lambda: not alive(victim_workers), 10, what="the lost node's worker to die")
    # Survivors form a new round at world size 2 without spending the (zero) restart budget.
    wait_until(lambda: any(s.world == 2 and s.t > killed_at for s in read_steps(steps_dir)), 60,
               what="steps at world 2")
    assert a0.proc.poll() is None and a1.proc.poll() is None, agents.outputs()
    assert "node(s) lost since the last round" in a0.output() + a1.output()
    assert "restarts used 0/0" in a0.output()


def test_lone_node_starts_a_second_joins_then_is_lost(agents, tmp_path):
    """A 1:2 job's lone node starts after the short last call; a second node joins (world 2, the host
    keeps group rank 0); the joiner is SIGKILLed and the host steps on alone.  (Once two tests, four
    agents: the lone start with the join, and two nodes losing the second.)

    The joiner's template imports a ``--preload`` module that takes 3 s: the joiner defers its join
    until its template is ready (elastrun/agent/join_gate.py), and the lone node trains meanwhile."""
    steps_dir = tmp_path / "steps"
    steps_dir.mkdir()
    (tmp_path / "slow_preload.py").write_text("import time\n\ntime.sleep(3)\n")
    env = base_env(STEPS_LOG=str(steps_dir), STEPS="100000", STEP_SECONDS="0.05")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    flags = _flags(free_port(), "1:2", "lone-join-lose")
    (a0,) = _start_host_first(agents, flags, env, 1)
    # A lone node of a 1:2 job starts after the short last call, not torchrun's 30 s.
    wait_until(lambda: any(s.world == 1 for s in read_steps(steps_dir)), 60, what="lone node stepping")
    assert "round 0 formed in" in a0.output()
    formed = float(a0.output().split("round 0 formed in ")[1].split(" s")[0])
    assert formed < 10, a0.output()
    joined_at = time.time()
    joiner_logs = tmp_path / "logs1"
    a1 = agents.start([*flags, "--preload=slow_preload", f"--log-dir={joiner_logs}"], env=env, name="agent1")

    def ranks_at_two() -> set[int]:
        return {s.rank for s in read_steps(steps_dir) if s.world == 2 and s.t > joined_at}

    # Each rank logs its own steps: wait for both (rank 0's first step can come before rank 1's is logged).
    wait_until(lambda: ranks_at_two() == {0, 1}, 60, what="steps of ranks 0 and 1 at world 2 after the join")
    assert "waiting to join" in a0.output()
    # The joiner waited for its template before it joined, and the lone node stepped all that while.
    (deferred,), (resumed,) = events(joiner_logs, "join_deferred"), events(joiner_logs, "join_resumed")
    assert resumed["ended_by"] == "ready", resumed
    meanwhile = [s for s in read_steps(steps_dir) if s.world == 1 and deferred["ts"] + 1 < s.t < resumed["ts"]]
    assert meanwhile, f"the lone node did not step while the joiner started up ({resumed})\n{agents.outputs()}"
    # The host keeps group rank 0 across the resize; the newcomer gets rank 1.
    assert "this node is group rank 0" in a0.output().split("round 1")[-1]
    assert a1.proc.poll() is None, agents.outputs()

    killed_at = time.time()
    a1.kill(signal.SIGKILL)
    wait_until(lambda: any(s.world == 1 and s.t > killed_at for s in read_steps(steps_dir)), 60,
               what="survivor stepping alone")
    assert a0.proc.poll() is None, a0.output()


def test_peer_failing_from_a_stop_for_a_joiner_is_not_charged(agents, job, tmp_path):
    """Nodes 0 and 1 train; node 2 joins.  Node 0 sees the joiner first and stops its worker, which
    fails node 1's worker in its collective before node 1's agent has polled (it is SIGSTOPped here,
    which makes the race certain).  That failure is a consequence of the growth: with
    ``--max-restarts=0`` the job goes on at three nodes instead of failing."""
    job.nnodes, job.run_id = "1:3", "grow-race"
    env = steps_env(tmp_path)
    steps_dir = tmp_path / "steps"
    patient = ("--rdzv-conf=heartbeat_timeout=30",)  # node 1 is stopped for a few seconds, not lost
    a0, a1, logs = start_pair(agents, job, tmp_path, env, both=patient)
    try:
        wait_until(lambda: {s.rank for s in read_steps(steps_dir) if s.world == 2} == {0, 1}, 90,
                   what="both nodes stepping in one group")
        a1.kill(signal.SIGSTOP)
        a2 = agents.start(job.flags(tmp_path / "logs2", *patient), env=env, name="agent2")
        wait_until(lambda: "waiting to join" in a0.output(), 60, what="node 0 to see the joiner")

        def rank1_stopped() -> bool:  # its worker failed (or at least stopped stepping) for 1 s
            last = max((s.t for s in read_steps(steps_dir) if s.rank == 1 and s.world == 2), default=0.0)
            return time.time() - last > 1.0

        wait_until(rank1_stopped, 30, what="node 1's worker to stop stepping")
        a1.kill(signal.SIGCONT)
        _three_stepping(steps_dir, (a0, a1, a2))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    finally:
        a1.kill(signal.SIGCONT)
    assert all(a.proc.poll() is None for a in (a0, a1, a2)), agents.outputs()
    # The race did happen: node 1's worker failed in its collective when node 0 stopped.  Node 1's
    # agent, resumed, reports that failure (the mark makes it uncharged), unless its poll sees the
    # joiner before the worker's exit reaches it: then it stops for the joiner and reports nothing.
    assert "Traceback" in a1.output() or "failed (exit code 1)" in a1.output(), agents.outputs()
    assert "restarts used 0/0" in a0.output().split("round 2")[-1], agents.outputs()


def _has_joined(job, round_: int, node: str) -> bool:
    """Whether ``node`` has joined round ``round_`` of the job, read as ``elastrun status`` reads it."""
    doc = read_status(RendezvousParameters(job.backend, job.endpoint, job.run_id, 1, 1), 3.0)
    return doc["open_round"] == round_ and node in {w.get("node_id") for w in doc["waiting"]}


def test_a_joiner_waiting_for_its_imports_joins_the_round_a_fault_starts(agents, job, tmp_path):
    """Nodes 0 and 1 train; node 2 starts with a 10 s ``--preload`` and defers its join.  Meanwhile
    node 1's agent is stopped (SIGSTOP: the round after a fault cannot close without it) and rank 0
    fails: node 0 goes round again, and the waiting joiner must join that forming round at once,
    not wait for its imports and stop the new group a second time.  Node 1 resumed, the round
    closes with all three nodes (one restart charged), and they train together."""
    job.nnodes, job.run_id = "2:3", "gate-fault"
    env = steps_env(tmp_path)
    steps_dir = tmp_path / "steps"
    crash = tmp_path / "crash"
    env.update(CRASH_FILE=str(crash), CRASH_RANK="0", CRASH_ONCE_FILE=str(tmp_path / "crashed"))
    (tmp_path / "slow_preload.py").write_text("import time\n\ntime.sleep(10)\n")
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    patient = ("--rdzv-conf=heartbeat_timeout=30", "--max-restarts=1")  # node 1 is stopped, not lost
    a0, a1, logs = start_pair(agents, job, tmp_path, env, both=patient)
    joiner_logs = tmp_path / "logs2"
    try:
        wait_until(lambda: {s.rank for s in read_steps(steps_dir) if s.world == 2} == {0, 1}, 90,
                   what="both nodes stepping in one group")
        a2 = agents.start(job.flags(joiner_logs, *patient, "--preload=slow_preload"), env=env, name="agent2")
        wait_until(lambda: events(joiner_logs, "join_deferred") or a2.proc.poll() is not None, 60,
                   what="the joiner deferring its join")
        a1.kill(signal.SIGSTOP)
        crash.touch()
        wait_until(lambda: events(joiner_logs, "join_resumed"), 30, what="the joiner to join")
        (resumed,) = events(joiner_logs, "join_resumed")
        assert resumed["ended_by"] == "round forming", resumed
        # Its join lands a moment after it decided to join: node 1 resumed before that would close the
        # round with the two old members alone (seen once in a loaded run, when rank 0 was node 1's).
        wait_until(lambda: _has_joined(job, 1, resumed["node"]), 30, what="the joiner's join in round 1")
        a1.kill(signal.SIGCONT)
        _three_stepping(steps_dir, (a0, a1, a2))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{agents.outputs()}") from None
    finally:
        a1.kill(signal.SIGCONT)
    assert all(a.proc.poll() is None for a in (a0, a1, a2)), agents.outputs()
    # The round that followed the fault admitted the joiner: no second round for it.
    (second,) = [e for e in events(logs[0], "round_closed") if e["round"] == 1]
    assert second["group_world_size"] == 3, second
    assert second["restarts_used"] == 1, second
