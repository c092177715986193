"""One goodput figure per job (issue 34): the agent's last line, ``elastrun goodput``, ``elastrun
status --log-dir`` and the metrics' computation give the same figure for a finished run.

A real agent runs two elastrun.train workers whose script ends 1.5 s after its last step: before the
fix the agent measured before logging its own exit and counted that end as a step in progress.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastrun.observe.cli import goodput_so_far
from elastrun.observe.goodput_report import GoodputTracker
from tests.harness import REPO, base_env

pytestmark = pytest.mark.e2e

JOB = Path(__file__).with_name("late_end_job.py")
_PREFIX = re.compile(r"^elastrun\[[^\]]+\] \d\d:\d\d:\d\d ")


def test_the_agents_last_line_is_the_jobs_goodput(agents, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", f"--log-dir={logs}"], script=[str(JOB)],
                         env=base_env(END_SECONDS="1.5"))
    assert agent.wait(120) == 0, agent.output()
    last = _PREFIX.sub("", agent.output().rstrip().splitlines()[-1])
    assert last.startswith("goodput "), agent.output()

    command = subprocess.run([sys.executable, "-m", "elastrun", "goodput", str(logs)], cwd=REPO, env=base_env(),
                             capture_output=True, text=True, timeout=60)
    assert command.returncode == 0, command.stderr
    assert command.stdout.rstrip().splitlines()[-1] == last

    status = goodput_so_far(str(logs))  # what `elastrun status --log-dir` shows: the job has ended
    assert status["live"] is False and status["summary"] == last, status

    tracker = GoodputTracker([logs])  # what the metrics compute from, fed the events of the run
    for path in logs.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            tracker(json.loads(line))
    assert tracker.summary_line() == last
