"""A closed pipe ends every elastrun command quietly, as it ends a Unix tool (``elastrun --help | head``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.harness import REPO, base_env

pytestmark = pytest.mark.e2e


def _through_closed_pipe(argv: list[str], buffered: bool) -> tuple[int, str]:
    """Run ``python -m elastrun ARGV`` with its stdout a pipe whose reader is already gone."""
    env = base_env()
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "elastrun", *argv], cwd=REPO, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=60)
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr.decode(errors="replace")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["status", "--help"], ["timeline", "--help"],
                                  ["goodput", "--help"]])
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_closed_pipe_ends_the_command_quietly_by_sigpipe(argv: list[str], buffered: bool) -> None:
    code, err = _through_closed_pipe(argv, buffered)
    assert code == -signal.SIGPIPE, (code, err)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "", err


def test_help_into_head_prints_the_first_lines_and_no_traceback() -> None:
    shell = f"'{sys.executable}' -m elastrun --help | head -3; echo \"status=${{PIPESTATUS[0]}}\""
    proc = subprocess.run(["bash", "-c", shell], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=60)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: elastrun"), proc.stdout
    assert lines[-1] in ("status=141", "status=0"), proc.stdout  # 0 when the whole text fit in the pipe
    assert "Traceback" not in proc.stderr, proc.stderr
