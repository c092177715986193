"""Consequences are not causes (issue 34): a rank that failed only because its peer died gets one
console line naming the peer, its traceback stays in its error file, and the root cause named on
every node is the peer; a rank's own error is shown in full (docs/failures.md).

Real agents, real workers in a DDP loop (gloo).  The survivor of a peer's death must print its
traceback before its agent sees either death, as happens on a busy host (the agent otherwise kills
it first, and it prints nothing): each test stops the agent (SIGSTOP) while the fault happens and
both workers end, then lets it go on, so it finds both deaths in one look with the survivor's
traceback waiting in its pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elastrun.agent.aftermath import is_peer_error
from tests.agent.jobs import events, start_pair, steps_env
from tests.harness import Agent, read_steps, wait_until

pytestmark = pytest.mark.e2e


def _pids(log_dir: Path) -> dict[int, int]:
    """The latest worker PID of each global rank this agent started."""
    return {e["rank"]: e["pid"] for e in sorted(events(log_dir, "worker_start"), key=lambda e: e["round"])}


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # a child of the stopped agent
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def _stopped(agent: Agent) -> Iterator[None]:
    """The agent stopped (SIGSTOP) for the block, then continued."""
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(agent.pid, signal.SIGCONT)


def _traceback_lines(out: str, rank: int) -> list[str]:
    return [line for line in out.splitlines()
            if re.match(rf"\[node\d+ rank{rank}\]: (\[rank{rank}\]: )?Traceback \(most recent call last\)", line)]


def _one_line(out: str, rank: int, because: str) -> Path:
    """The consequence line of ``rank`` (exactly one), and the file it names, which holds its traceback."""
    lines = [line for line in out.splitlines() if f"rank {rank} stopped: " in line]
    assert len(lines) == 1, out
    m = re.search(rf"rank {rank} stopped: {because} \(its traceback: (\S+)\)$", lines[0])
    assert m, lines[0]
    kept = Path(m[1])
    text = json.loads(kept.read_text())["message"]["extraInfo"]["py_callstack"]
    assert "Traceback (most recent call last)" in text
    return kept


GLOO = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    loss.backward()\n"
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:6048. This is typically caused by a remote worker crashing.\n")


@pytest.mark.parametrize(("message", "signal_name", "peer"), [
    (GLOO, None, True),
    ("\n".join("[rank0]: " + line for line in GLOO.splitlines()), None, True),  # a stderr tail, torch's prefix
    ("Traceback (most recent call last):\n  File \"t.py\", line 1\ntorch.distributed.DistBackendError: [1] is "
     "setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but "
     "store->get('0') got error: Connection reset by peer\nException raised from recvBytes at x.cpp:1 (most recent "
     "call first):\nframe #0: c10::Error::Error(...)", None, True),  # a multi-line message with native frames
    ("terminate called after throwing an instance of 'c10::DistBackendError'\n  what():  [PG 0 Rank 1] Process "
     "group watchdog thread terminated with exception: NCCL error: remote process exited or there was a network "
     "error", "SIGABRT", True),  # NCCL's watchdog aborts the process
    ("Traceback (most recent call last):\n  File \"t.py\", line 1\nelastrun.train.reform.Reform: paused", None, True),
    (GLOO, "SIGKILL", False),  # killed from outside: whatever it printed before
    ("Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: the answer is not 42", None, False),
    # Its own error, raised while handling a peer's: the last exception is what it died of.
    (GLOO + "\nDuring handling of the above exception, another exception occurred:\n\n" +
     "Traceback (most recent call last):\n  File \"t.py\", line 2\nKeyError: 'step'", None, False),
    ("Traceback (most recent call last):\n  File \"conn.py\", line 3, in reset_connection_closed_by_peer\n"
     "ZeroDivisionError: division by zero", None, False),  # the words in a frame do not count
])
@pytest.mark.unit
def test_what_a_peer_error_is(message, signal_name, peer):
    assert is_peer_error(message, signal_name) is peer


def test_a_sigkilled_ranks_peer_gets_one_line_and_the_root_cause_is_the_killed_rank(agents, tmp_path):
    """The demo's fault on the plain loop: rank 1 SIGKILLed, rank 0's collective fails on the closed
    connection.  The budget is 0 (torchrun's default): the job ends with its root cause."""
    logs = tmp_path / "logs"
    env = steps_env(tmp_path)
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=0", f"--log-dir={logs}"], env=env)
    wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps")} == {0, 1}, 120, what="both ranks stepping")
    pids = _pids(logs)
    with _stopped(agent):
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: _ended(pids[0]), 60, what="rank 0 to fail on its dead peer")
    assert agent.wait(60) == 1, agent.output()
    out = agent.output()
    assert not _traceback_lines(out, 0), out
    assert "Connection" not in out and "GLHF" not in out, out  # nothing of the consequence on the console
    killed = out.index("error: rank 1 on ")
    assert "failed (killed by SIGKILL)" in out[killed:].splitlines()[0], out
    kept = _one_line(out, 0, "its peer rank 1 died")
    assert out.index("rank 0 stopped: ") > killed  # the culprit first
    assert kept.resolve() == (logs / "attempt_0" / "rank_0" / "error.json").resolve()
    assert "root cause: rank 1 (local rank 1)" in out, out


def test_an_application_error_is_shown_in_full_and_its_peer_gets_one_line(agents, tmp_path):
    """Rank 1 raises (a bug of the script): its traceback is on the console as printed, before the
    agent's line; rank 0, whose collective failed on rank 1's exit, gets one line."""
    logs = tmp_path / "logs"
    crash = tmp_path / "crash"
    env = steps_env(tmp_path)
    env.update(CRASH_FILE=str(crash), CRASH_RANK="1")
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=0", f"--log-dir={logs}"], env=env)
    wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps")} == {0, 1}, 120, what="both ranks stepping")
    pids = _pids(logs)
    with _stopped(agent):
        crash.touch()
        wait_until(lambda: _ended(pids[1]) and _ended(pids[0]), 60, what="rank 1 to raise and rank 0 to fail")
    assert agent.wait(60) == 1, agent.output()
    out = agent.output()
    (own,) = _traceback_lines(out, 1)
    assert re.search(r"\[node0 rank1\]: (\[rank1\]: )?RuntimeError: injected failure at step \d+\n", out), out
    said = out.index("error: rank 1 on ")
    assert out.index(own) < said and "failed (exit code 1): RuntimeError: injected failure" in out[said:], out
    assert not _traceback_lines(out, 0) and "Connection" not in out, out
    _one_line(out, 0, "its peer rank 1 died")
    assert out.index("rank 0 stopped: ") > said
    assert "root cause: rank 1 (local rank 1)" in out, out


def test_on_another_node_the_consequence_names_the_culprit_once_the_round_judged_it(agents, job, tmp_path):
    """Two agents of one worker each.  The worker of one is SIGKILLed; the other's worker fails on
    the closed connection before its agent knows anything.  That agent learns the culprit from the
    next round (its closer judged every node's failure records) and says it in one line; the round
    line and the recovery name it too."""
    env = steps_env(tmp_path)
    env["STEPS"] = "150"
    a0, a1, logs = start_pair(agents, job, tmp_path, env, both=("--max-restarts=1",))
    # The first agent may step alone first (--nnodes=1:2): wait for the group of two.
    wait_until(lambda: {s.rank for s in read_steps(tmp_path / "steps") if s.world == 2} == {0, 1}, 120,
               what="both ranks stepping in a world of 2")
    pids = {rank: (agent, log, pid) for agent, log in ((a0, logs[0]), (a1, logs[1]))
            for rank, pid in _pids(log).items()}
    victim, _, victim_pid = pids[1]
    survivor, survivor_logs, survivor_pid = pids[0]
    with _stopped(survivor):
        os.kill(victim_pid, signal.SIGKILL)
        wait_until(lambda: _ended(survivor_pid), 60, what="rank 0 to fail on its dead peer")
    assert survivor.wait(120) == 0 and victim.wait(60) == 0, agents.outputs()
    out = survivor.output()
    assert "failed (killed by SIGKILL)" in victim.output(), agents.outputs()
    assert not _traceback_lines(out, 0) and "Connection" not in out, agents.outputs()
    kept = _one_line(out, 0, r"its peer rank 1 on \S+ died")
    assert kept.resolve().parent.parent.parent == survivor_logs.resolve() and kept.name == "error.json", kept
    assert "error: rank 0" not in out, out  # never blamed
    assert re.search(r"round \d+ formed in [\d.]+ s after the failure of rank 1 on \S+ \(killed by SIGKILL\)",
                     out), out
    assert re.search(r"workers running again [\d.]+ s after the failure of rank 1 on \S+\n", out), out
    # The events of both nodes say which failure was a consequence.
    recorded = {e["rank"]: e["peer_error"] for log in logs for e in events(log, "worker_failure")}
    assert recorded.get(1) is False and recorded.get(0, True) is True, recorded
