"""Signals: forwarded to workers, grace period then SIGKILL, conventional exit codes (a SIGKILLed agent
leaves no orphans: tests/workers/test_pool.py)."""

import os
import signal

import pytest

from tests.agent.jobs import events, steps_env
from tests.harness import SCRIPTS, alive, base_env, wait_until

pytestmark = pytest.mark.e2e


def _start(agents, tmp_path, *extra_flags, **env):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    agent = agents.start(["--standalone", "--nproc-per-node=2", *extra_flags],
                         script=[str(SCRIPTS / "signals.py")], env=base_env(OUT_DIR=str(out), **env))
    wait_until(lambda: (out / "ready_0").exists() and (out / "ready_1").exists(), 60, what="workers ready")
    return agent, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_is_forwarded_and_agent_exits_with_its_code(agents, tmp_path, sig):
    agent, out = _start(agents, tmp_path)
    workers = agent.descendants()
    os.kill(agent.pid, sig)
    assert agent.wait(30) == 128 + sig
    for rank in (0, 1):
        assert (out / f"{sig.name}_{rank}").exists(), agent.output()
    assert not alive(workers)


def test_workers_ignoring_sigterm_are_killed_after_grace(agents, tmp_path):
    agent, out = _start(agents, tmp_path, "--stop-timeout=1", IGNORE_SIGNALS="1")
    workers = agent.descendants()
    os.kill(agent.pid, signal.SIGTERM)
    assert agent.wait(30) == 128 + signal.SIGTERM
    assert not (out / "SIGTERM_0").exists()
    assert not alive(workers)
    assert "1 s before SIGKILL" in agent.output()


def test_signal_during_the_first_rendezvous_exits_with_its_code(agents, job, tmp_path):
    """A lone agent of a two-node job waits in its first round; SIGTERM ends it with 143 (not the
    exit 1 of a lost rendezvous), having left the round."""
    sig = signal.SIGTERM
    job.nnodes = "2"
    logs = tmp_path / "logs"
    agent = agents.start(job.flags(logs), env=steps_env(tmp_path), name="agent0")
    wait_until(lambda: events(logs, "round_start") or agent.proc.poll() is not None, 60, what="the first round")
    os.kill(agent.pid, sig)
    assert agent.wait(30) == 128 + sig, agent.output()
    assert [e["action"] for e in events(logs, "signal")] == ["left during rendezvous"], agent.output()
