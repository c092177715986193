"""A process whose process-group set-up failed can set one up again with a fresh process (issue 35).

torch names the default group from a counter of unnamed groups ("0", "1", ...) before it builds
it, and that name is the prefix of the group's keys in the store (``0/``).  A failed
``init_process_group`` (a peer that never came, or, under ``et.run``, a pause that shut the
set-up's connections when a second change came during a re-form) kept the counter, so the
process's next group was ``1/`` while a freshly started peer's was ``0/``: they never met, and the
group formed by the rendezvous never took a step.  ``init_distributed`` undoes the name of a
failed set-up, as ``destroy_process_group`` does for a destroyed one.

Two real processes, gloo on loopback, stores hosted here.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import warm
from tests.harness import base_env, free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

KEPT = """
import os, sys, torch, torch.distributed as dist
from elastrun.shared import procexit
from elastrun.train.dist import init_distributed
os.environ.update(MASTER_PORT=sys.argv[1], TORCHELASTIC_RESTART_COUNT="1")
try:
    init_distributed("gloo", timeout_s=2.0)  # its peer never comes
    sys.exit("the first set-up should have failed")
except Exception as exc:
    print("first set-up failed:", type(exc).__name__, flush=True)
os.environ.update(MASTER_PORT=sys.argv[2], TORCHELASTIC_RESTART_COUNT="2")
init_distributed("gloo", timeout_s=float(sys.argv[3]))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
procexit.leave(0)  # as elastrun's workers end: torch's own teardown can abort after the work is done
"""

FRESH = """
import sys, torch, torch.distributed as dist
from elastrun.shared import procexit
from elastrun.train.dist import init_distributed
init_distributed("gloo", timeout_s=float(sys.argv[1]))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
procexit.leave(0)  # as elastrun's workers end: torch's own teardown can abort after the work is done
"""


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def test_a_failed_set_up_leaves_no_trace_for_the_next_group(tmp_path):
    first, second = _store(), _store()
    env = dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               TORCHELASTIC_USE_AGENT_STORE="True", TORCH_CPP_LOG_LEVEL="ERROR")
    env.pop("ELASTRUN_SNAPSHOT_DIR", None)
    timeout = "20"
    procs: list[subprocess.Popen] = []
    try:
        with open(tmp_path / "kept.log", "wb") as kept_log, open(tmp_path / "fresh.log", "wb") as fresh_log:
            kept = warm.popen([sys.executable, "-c", KEPT, str(first.port), str(second.port), timeout],
                              env={**env, "RANK": "0"}, stdout=kept_log, stderr=subprocess.STDOUT)
            procs.append(kept)
            fresh = warm.popen([sys.executable, "-c", FRESH, timeout],
                               env={**env, "RANK": "1", "MASTER_PORT": str(second.port),
                                    "TORCHELASTIC_RESTART_COUNT": "2"},
                               stdout=fresh_log, stderr=subprocess.STDOUT)
            procs.append(fresh)
            codes = [p.wait(120) for p in procs]
        out = {name: (tmp_path / f"{name}.log").read_text() for name in ("kept", "fresh")}
        assert "first set-up failed" in out["kept"], out
        assert codes == [0, 0], out
        assert "sum 2.0" in out["kept"] and "sum 2.0" in out["fresh"], out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_change_during_a_re_form_s_set_up_keeps_the_survivor_and_the_job_steps_on(agents, tmp_path):
    """The soak's sequence: rank 1 dies, rank 0 keeps its process and waits in its new group's set-up
    for the new rank 1, which dies too before it sets up its own: the agent pauses rank 0 in the
    middle of ``init_process_group``.  Kept again, rank 0 must meet the next fresh rank 1 and step on
    at once.  Before the fix the two named their group differently and never met: the round formed,
    nobody stepped (caught only by the start-up bound, which restarted rank 0)."""
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--hang-timeout=2", "--max-restarts=3",
                          "--preload=torch,elastrun.train", "--event-log-stdout"],
                         script=[str(REPO / "tests" / "scripts" / "reform_faults.py")],
                         env=base_env(STALL_DIR=str(tmp_path), FAULT="exit-during-init"))
    assert agent.wait(150) == 0, agent.output()[-6000:]
    out = agent.output()
    events = [json.loads(line[line.index('{"ts"'):]) for line in out.splitlines() if '{"ts"' in line]
    kinds = [e["event"] for e in events]
    assert "stall" not in kinds and "hang_detected" not in kinds, out[-6000:]
    assert "reform_fallback" not in kinds, out[-6000:]
    starts = [(e["round"], e["rank"], e["pid"], e["start_method"]) for e in events if e["event"] == "worker_start"]
    rank0 = {pid for _, rank, pid, _ in starts if rank == 0}
    assert len(rank0) == 1 and len(starts) == 6, starts  # rank 0 kept its process through 3 rounds
    failures = [(e["rank"], e["exitcode"], e["signal"]) for e in events if e["event"] == "worker_failure"]
    assert failures == [(1, None, "SIGKILL"), (1, 3, None)], failures
    assert [e["kept"] for e in events if e["event"] == "reform"] == [[0]], out[-6000:]  # the last re-form completed
    assert "done rank 0 step 40" in out and "done rank 1 step 40" in out


REPEATED = """
import os, sys, torch.distributed as dist
from elastrun.train.dist import init_distributed
for port in sys.argv[1:]:
    os.environ["MASTER_PORT"] = port
    init_distributed("gloo", timeout_s=20.0)
    dist.destroy_process_group()
raise ValueError("the script's own error")
"""


def test_a_traceback_after_many_groups_carries_one_rank_prefix(tmp_path):
    """torch wraps ``sys.excepthook`` at every ``init_process_group`` to prefix lines with the rank;
    a worker kept through 3 re-forms printed ``[rank0]: [rank0]: [rank0]: Traceback ...`` and the
    agent, stripping one prefix, could not find the exception.  Each line must carry exactly one."""
    ports = [str(free_port()) for _ in range(3)]
    env = dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1",
               TORCH_CPP_LOG_LEVEL="ERROR")
    done = warm.run([sys.executable, "-c", REPEATED, *ports], env=env, capture_output=True, text=True,
                    timeout=120)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "[rank0]: Traceback (most recent call last):" in lines, done.stderr
    assert "[rank0]: ValueError: the script's own error" in lines, done.stderr
    assert not [line for line in lines if line.startswith("[rank0]: [rank0]:")], done.stderr
