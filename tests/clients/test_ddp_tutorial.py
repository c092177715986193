"""PyTorch's DDP tutorial pattern: a snapshot saved by LOCAL_RANK 0, loaded on every start,
``destroy_process_group()`` at the end.  Under elastrun, unmodified, a worker is killed mid-run and
the restarted group resumes from the snapshot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.clients.harness import SCRIPTS, failures, kill_worker, wait_output
from tests.harness import Cluster

pytestmark = pytest.mark.e2e

SCRIPT = SCRIPTS / "ddp_tutorial.py"
EPOCHS = 6


def test_ddp_tutorial_resumes_from_its_snapshot_after_a_worker_kill(agents: Cluster, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={log_dir}"],
                         [str(SCRIPT), str(EPOCHS), "1", "--snapshot-path", str(tmp_path / "snapshot.pt"),
                          "--step-seconds", "0.05"])
    first = wait_output(agent, r"rank0\]: \[RANK0\] Epoch 0 \| Batchsize: 32 \| Steps: 8$", 120)
    assert "Loading snapshot" not in agent.output()[:first.start()]
    seen = wait_output(agent, r"rank0\]: Epoch 1 \| Training snapshot saved at", 120)
    kill_worker(log_dir, rank=1)
    assert agent.wait(180) == 0, agent.output()[-4000:]
    (failure,) = failures(log_dir)
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL"), failure
    rest = agent.output()[seen.end():]
    resumed = {int(r): int(e) for r, e in re.findall(
        r"rank(\d)\]: Resuming training from snapshot at Epoch (\d+)", rest)}
    assert set(resumed) == {0, 1} and all(2 <= e < EPOCHS for e in resumed.values()), rest[-3000:]
    assert f"[RANK0] Epoch {EPOCHS - 1} |" in rest and f"[RANK1] Epoch {EPOCHS - 1} |" in rest
    assert "rank0]: [RANK0] done" in rest and "rank1]: [RANK1] done" in rest
