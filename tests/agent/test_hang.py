"""Hang detection from progress heartbeats, and the crash-loop stop."""

import pytest

from elastrun.config import EXIT_NO_REQUEUE
from tests.harness import SCRIPTS, base_env


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
