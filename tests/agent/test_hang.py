"""Hang detection from progress heartbeats, and the crash-loop stop."""

import pytest

from elastrun.config import EXIT_NO_REQUEUE
from tests.harness import SCRIPTS, base_env

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("mode", ["sleep", "stop"])
def test_hung_worker_is_dumped_and_killed(agents, mode):
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--hang-timeout=2"],
                         script=[str(SCRIPTS / "hang.py")], env=base_env(HANG_MODE=mode))
    assert agent.wait(90) == 1, agent.output()
    out = agent.output()
    assert "rank 1 is hung: no heartbeat for" in out
    assert "root cause: rank 1" in out and "hang detected" in out
    if mode == "sleep":
        # faulthandler's dump of the stuck worker names the function it hangs in.
        assert "stuck_in_the_middle" in out


def test_crash_loop_stops_with_do_not_requeue(agents, tmp_path):
    script = tmp_path / "fail_fast.py"
    script.write_text("import sys\nsys.exit(7)\n")
    agent = agents.start(["--standalone", "--nproc-per-node=1", "--max-restarts=10", "--crash-loop-limit=2"],
                         script=[str(script)])
    assert agent.wait(90) == EXIT_NO_REQUEUE, agent.output()
    out = agent.output()
    assert "crash loop (2 failed attempts in a row without progress" in out
    assert "exit code 7" in out
    assert "restarts used 1/10" in out  # it stopped long before spending the budget


def test_a_group_stalled_in_its_restore_after_a_re_form_is_caught_by_the_learned_start_up_bound(agents, tmp_path):
    """Rank 1 dies; rank 0 keeps its process and then blocks in its restore, the new rank 1 waiting
    for it in the restore's collective: no heartbeat from either.  The bound learned from the first
    round's starts catches it: the console says what each rank was doing, both stacks are written
    (the culprit's as it is killed, the other's with it living on), and the job goes on to exit 0.
    Without the bound nothing judges a worker before its first heartbeat and the job never ends."""
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--hang-timeout=2", "--max-restarts=3",
                          "--preload=torch,elastrun.train", "--event-log-stdout"],
                         script=[str(SCRIPTS / "reform_faults.py")],
                         env=base_env(STALL_DIR=str(tmp_path), FAULT="block-restore"))
    assert agent.wait(150) == 0, agent.output()[-6000:]
    out = agent.output()
    assert (tmp_path / "blocked").exists(), out[-3000:]
    stalls = [e for e in _events(out) if e["event"] == "stall"]
    assert len(stalls) == 1, out[-6000:]
    [stall] = stalls
    assert stall["reason"].startswith("no first heartbeat") and "learned: 5 x the slowest of 2 start(s)" in \
        stall["reason"], stall
    workers = {w["rank"]: w for w in stall["workers"]}
    assert workers[0]["entered"] == "kept" and workers[0]["reformed"] is None, stall
    assert workers[0]["doing"] == "not re-formed yet: in its new process group's set-up or its restore"
    assert workers[1]["beats"] == 0 and workers[1]["entered"] != "kept", stall
    assert stall["stacks"] == [1], stall  # rank 0, the culprit, is dumped by SIGABRT as it is killed
    assert "rank 0 is hung: no first heartbeat" in out
    assert "in blocked_in_restore" in out  # the culprit's stack
    assert "in all_gather" in out  # rank 1's, waiting for rank 0 in the restore's collective
    assert "done rank 0 step 40" in out and "done rank 1 step 40" in out


def _events(output: str) -> list[dict]:
    import json

    found = []
    for line in output.splitlines():
        start = line.find('{"ts"')
        if start >= 0:
            try:
                found.append(json.loads(line[start:]))
            except ValueError:
                continue
    return found
