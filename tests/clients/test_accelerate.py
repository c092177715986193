"""Hugging Face Accelerate: an ``Accelerator()`` script trains under elastrun unmodified and survives
a worker's SIGKILL (``--max-restarts=1``), resuming from its own ``save_state`` checkpoint."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.clients.harness import SCRIPTS, failures, kill_worker, wait_output
from tests.harness import Cluster

# find_spec, not importorskip: the script imports Accelerate in its workers, and importing it here would cost
# every pytest process that collects this file a second.
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="Hugging Face Accelerate is not installed (the dev extra has it)")]

SCRIPT = SCRIPTS / "accelerate_train.py"
EPOCHS = 6


def test_accelerate_script_trains_on_two_processes_and_survives_a_worker_kill(agents: Cluster,
                                                                             tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={log_dir}"],
                         [str(SCRIPT), "--epochs", str(EPOCHS), "--output-dir", str(tmp_path / "out"),
                          "--step-seconds", "0.05"])
    wait_output(agent, r"rank0\]: num_processes 2 distributed_type DistributedType.MULTI_CPU$", 120)
    seen = wait_output(agent, r"rank0\]: epoch 1 accuracy", 120)
    kill_worker(log_dir, rank=1)
    assert agent.wait(180) == 0, agent.output()[-4000:]
    out = agent.output()
    (failure,) = failures(log_dir)
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL"), failure
    rest = out[seen.end():]
    # The restarted group: two processes again, resumed from the last complete save_state, then done.
    assert re.search(r"rank0\]: num_processes 2 ", rest), rest[-3000:]
    resumed = re.search(r"rank0\]: resumed from \S+ at epoch (\d+)", rest)
    assert resumed and 1 <= int(resumed[1]) < EPOCHS, rest[-3000:]
    assert f"rank0]: done: {EPOCHS} epochs" in rest
