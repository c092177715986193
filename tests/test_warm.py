"""The warm starter (tests/warm.py) that most end-to-end tests start their agents with.

It must give what ``subprocess`` gives an exec'd agent (exit code, signals, stdio, environment,
session) and an agent that still forks its template from itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests import warm
from tests.harness import REPO, base_env, remove_runtime_dirs, wait_until

pytestmark = pytest.mark.e2e

PROBE = """
import json, os, sys, torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
               "probe_var": os.environ.get("PROBE_VAR"), "cwd": os.getcwd(), "pid": os.getpid()}, f)
print("to stdout", rank, flush=True)
dist.destroy_process_group()
sys.exit(int(os.environ.get("PROBE_EXIT", "0")) if rank == 1 else 0)
"""


@pytest.mark.skipif(warm.cold(), reason="ELASTRUN_TEST_COLD=1: every agent is exec'd")
def test_a_warm_agent_is_the_command_with_its_template_forked(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = base_env(PROBE_DIR=str(tmp_path), PROBE_VAR="seen")
    cmd = [sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "-v", str(script)]
    done = warm.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "template exec'd" not in done.stderr, done.stderr[-3000:]  # forked from the warm agent
    assert "to stdout 0" in done.stdout and "to stdout 1" in done.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        # Two workers: OMP_NUM_THREADS=1, as the template loaded torch with, and the request's own variable.
        assert (rank["threads"], rank["omp"], rank["probe_var"], rank["cwd"]) == (1, "1", "seen", str(tmp_path))

    failed = warm.run(cmd, cwd=tmp_path, env={**env, "PROBE_EXIT": "3"}, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1, failed.stderr[-3000:]  # a worker's failure is the agent's exit code 1


@pytest.mark.skipif(warm.cold(), reason="ELASTRUN_TEST_COLD=1: every agent is exec'd")
def test_a_warm_agent_takes_signals_by_pid_and_leads_its_own_session(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(120)\n")
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = warm.popen([sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=1", str(script)],
                          cwd=REPO, env=base_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    family: list[psutil.Process] = []
    try:
        assert isinstance(proc, warm.WarmProcess)
        assert os.getsid(proc.pid) == proc.pid and proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
        family = wait_until(lambda: psutil.Process(proc.pid).children(recursive=True), 60, what="the worker")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        assert proc.poll() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for child in family:
            with contextlib.suppress(psutil.Error):
                child.kill()
        remove_runtime_dirs({proc.pid})  # a SIGKILLed agent leaves its /dev/shm directory


@pytest.mark.skipif(warm.cold(), reason="ELASTRUN_TEST_COLD=1: every command is exec'd")
def test_code_and_scripts_run_as_the_interpreter_runs_them(tmp_path):
    code = "import sys, torch; print(sys.argv, __name__, sys.path[0] == '', flush=True); sys.exit(int(sys.argv[1]))"
    done = warm.run([sys.executable, "-c", code, "3"], capture_output=True, text=True, timeout=60, env=base_env())
    assert (done.returncode, done.stdout) == (3, "['-c', '3'] __main__ True\n"), done.stderr
    script = tmp_path / "probe_script.py"
    script.write_text("import os, sys\nprint(sys.argv[1:], __name__, sys.path[0] == os.path.dirname(__file__))\n"
                      "raise ValueError('the script failed')\n")
    done = warm.run([sys.executable, str(script), "x"], capture_output=True, text=True, timeout=60, env=base_env())
    assert (done.returncode, done.stdout) == (1, "['x'] __main__ True\n"), done.stderr
    assert done.stderr.rstrip().endswith("ValueError: the script failed"), done.stderr


def test_interpreter_options_and_the_cold_switch_go_to_subprocess(monkeypatch):
    plain = warm.popen([sys.executable, "-S", "-c", "pass"])
    assert isinstance(plain, subprocess.Popen) and plain.wait(30) == 0
    monkeypatch.setenv("ELASTRUN_TEST_COLD", "1")
    cold = warm.popen([sys.executable, "-m", "elastrun", "--version"], stdout=subprocess.PIPE, text=True,
                      env=base_env(ELASTRUN_TEST_COLD="1"), cwd=REPO)
    assert isinstance(cold, subprocess.Popen)
    out, _ = cold.communicate(timeout=60)
    assert cold.returncode == 0 and out.strip()
