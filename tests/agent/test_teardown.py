"""A job whose scripts finished ends with exit 0, whatever their interpreters do on the way out.

Workers run through :mod:`elastrun.workers.bootstrap`, which reports the script's exit code to
the agent before the interpreter's exit and leaves with ``os._exit``.  These tests run real agents
with workers that abort or hang *after* their script returned (the agent must keep exit 0, warn,
and spend nothing) or abort *before* it returned (still a failure), under both start methods;
and the stress shape of torch's own teardown race: a DDP model freed right after its last
all-reduce, many jobs in a row with default flags.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.harness import REPO, SCRIPTS, base_env

TEARDOWN = str(SCRIPTS / "teardown.py")


def launch(tmp_path, flags: list[str], script: str, timeout: float = 120.0, **env: str):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "elastrun", "--standalone", *flags, script],
                          cwd=REPO, env=base_env(**env), capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_abort_after_the_script_returned_keeps_exit_0(tmp_path, method):
    proc, _ = launch(tmp_path, ["--nproc-per-node=2", f"--start-method={method}"], TEARDOWN,
                     TEARDOWN="abort-after", TEARDOWN_RANK="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "work done 0" in proc.stdout and "work done 1" in proc.stdout
    warning = re.search(r"rank 1 killed by SIGABRT .* after its script returned with exit code 0", proc.stderr)
    assert warning, proc.stderr[-3000:]
    assert "starting a new round" not in proc.stderr


def test_hang_after_the_script_returned_is_ended(tmp_path):
    proc, took = launch(tmp_path, ["--nproc-per-node=2", "--stop-timeout=2"], TEARDOWN,
                        TEARDOWN="hang-after", TEARDOWN_RANK="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"rank 0 killed by SIGKILL .* after its script returned with exit code 0", proc.stderr)
    assert took < 60, f"the hung exit held the job for {took:.0f} s"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_abort_before_the_script_returned_is_a_failure(tmp_path, method):
    proc, _ = launch(tmp_path, ["--nproc-per-node=2", f"--start-method={method}"], TEARDOWN,
                     TEARDOWN="abort-before", TEARDOWN_RANK="0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 0" in proc.stderr and "SIGABRT" in proc.stderr
    assert "interpreter teardown" not in proc.stderr


def test_ddp_model_freed_after_the_last_allreduce_always_ends_clean(tmp_path):
    """Torch's teardown race, default flags: every job of a row must end with exit 0 (see bench_teardown)."""
    runs, nproc = 6, 4
    for i in range(runs):
        proc, took = launch(tmp_path, [f"--nproc-per-node={nproc}"], str(SCRIPTS / "ddp_del_model.py"), timeout=90)
        done = set(re.findall(r"done (\d+) ", proc.stdout))
        assert done == {str(r) for r in range(nproc)}, f"run {i}: not every rank finished\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, f"run {i}: exit {proc.returncode} after {took:.1f} s\n{proc.stderr[-3000:]}"
