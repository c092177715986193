"""A pause taken at the end of a ``commit()`` (a join): the rule, and a worker's side of it.

The rule (:mod:`elastrun.train.commit_pause`) is a pure function.  The worker's side runs in a
process of its own: a real control channel (the agent's ``ControlServer``), a real ``State`` on a
one-rank gloo group, the worker's ``Link`` with its interrupt signal, and the agent's ``Pause``
messages as the agent sends them.
"""

from __future__ import annotations

import json
import sys

import pytest

from elastrun.train.commit_pause import SLACK, CommitClock, commit_deadline
from tests import warm
from tests.train.harness import env


@pytest.mark.unit
def test_the_clock_knows_a_step_from_three_commits_and_forgets_it_at_a_reform():
    clock = CommitClock()
    assert clock.last is None and clock.gap is None
    for t in (10.0, 10.2):
        clock.committed(t)
    assert clock.last == 10.2 and clock.gap is None  # one gap may be a restore's first step
    for t in (10.4, 10.6, 15.0):  # the last gap is an evaluation: the median is the step
        clock.committed(t)
    assert clock.gap == pytest.approx(0.2)
    clock.reset()
    assert clock.last is None and clock.gap is None


@pytest.mark.unit
@pytest.mark.parametrize(("now", "last", "gap", "within", "expected"), [
    (10.1, 10.0, 0.2, 5.0, 10.0 + SLACK * 0.2),  # mid-step: wait up to SLACK steps after the last commit
    (10.1, 10.0, 3.0, 5.0, 15.1),  # a long step: the agent's bound comes first
    (10.1, 10.0, 6.0, 5.0, None),  # steps longer than the bound: leave now
    (11.0, 10.0, 0.2, 5.0, None),  # past its usual time (evaluation, a long pause): leave now
    (10.1, None, None, 5.0, None),  # never committed
    (10.1, 10.0, None, 5.0, None),  # no step measured yet
    (10.1, 10.0, 0.2, 0.0, None),  # a fault's pause
])
def test_a_worker_waits_for_its_next_commit_only_while_it_is_near(now, last, gap, within, expected):
    got = commit_deadline(now, last, gap, within)
    assert got == (None if expected is None else pytest.approx(expected))


WORKER = r"""
import json, os, sys, tempfile, time
from pathlib import Path
import torch
import torch.distributed as dist
import elastrun.train as et
from elastrun.agent.workers.control_server import ControlServer
from elastrun.shared.protocol import SOCKET_ENV, Pause, Paused
from elastrun.train import reform

mode = sys.argv[1]
work = Path(tempfile.mkdtemp())
os.environ["ELASTRUN_SNAPSHOT_DIR"] = str(work / "snap")
server = ControlServer(work / "control.sock")  # the agent's end, in this process
os.environ[SOCKET_ENV] = str(server.path)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
net = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
state = et.State(model=net, optimizer=opt)
link = reform._link = reform.Link()  # what et.run holds
link.start(0)
server.pump(1.0)
server.pump(0.2)
assert server.connected(os.getpid())

def step():
    net(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    state.commit()

def wait(cond, limit=5.0):
    end = time.monotonic() + limit
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()

out = {}
link.in_fn = True
if mode != "fresh":
    for _ in range(4):  # the usual step: 1 s (the next commit is waited for until 3 s after the last), or 50 ms
        time.sleep(1.0 if mode == "commit" else 0.05)
        step()
t0 = time.monotonic()
try:  # from the pause's sending on: its interrupt may come at any bytecode
    server.send(os.getpid(), Pause(within=5.0))
    if mode == "commit":  # the step goes on to its commit, which leaves
        assert wait(lambda: link.soft_pending), "the pause was not taken as a pause at the next commit"
        out["pending_before"] = link.pause_pending
        step()
    else:  # "late": the next commit does not come; "fresh": no step measured yet
        time.sleep(5.0)
    out["raised"] = None
except reform.Reform as exc:
    out["raised"] = str(exc)
out["step"] = state.step
out["after"] = round(time.monotonic() - t0, 3)
link.in_fn = False
out["asked"] = link.asked
out["live"] = state.live_step()
link.paused(state.live_step())
answer = server.wait_for([os.getpid()], (Paused,), 5.0).get(os.getpid())
out["answer"] = None if answer is None else {"live": answer.live, "at_commit": answer.at_commit}
out["soft_after"] = link.soft_pending
link.close()
server.close()
state.close()
dist.destroy_process_group()
print(json.dumps(out))
"""


def _run(mode: str) -> dict:
    done = warm.run([sys.executable, "-c", WORKER, mode], env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_a_worker_asked_to_pause_for_a_join_finishes_its_step_and_leaves_at_its_commit():
    got = _run("commit")
    assert got["pending_before"] is False, got  # nothing interrupted the step
    assert got["raised"] == "the group left at the end of commit 5 (a node joins)", got
    assert got["step"] == 5 and got["live"] == 5, got  # the step was kept, and the objects are whole
    assert got["answer"] == {"live": 5, "at_commit": True}, got
    assert got["soft_after"] is False, got


@pytest.mark.e2e
def test_a_worker_whose_next_commit_is_overdue_is_interrupted_where_it_is():
    got = _run("late")
    assert got["raised"] == "the agent asked this worker to leave its process group", got
    # about SLACK usual steps after the last commit, well before the 5 s sleep or the agent's 5 s bound
    assert got["after"] < 2.5, got
    assert got["answer"] == {"live": 4, "at_commit": False}, got


@pytest.mark.e2e
def test_a_worker_with_no_measured_step_is_interrupted_at_once():
    got = _run("fresh")
    assert got["raised"] == "the agent asked this worker to leave its process group", got
    assert got["after"] < 2.5, got  # at once: far below the 5 s sleep
    assert got["answer"]["at_commit"] is False, got
