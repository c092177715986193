"""PyTorch Lightning's ``Trainer(strategy="ddp")`` under elastrun, unmodified: it takes elastrun's
processes as torchrun's (two ranks, one world), and after a worker's SIGKILL the restarted group
resumes from ``last.ckpt``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tests.clients.harness import SCRIPTS, failures, kill_worker, wait_output
from tests.harness import Cluster

# find_spec, not importorskip: the script imports Lightning in its workers, and importing it here would cost
# every pytest process that collects this file 2.4 s.
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="PyTorch Lightning is not installed (the dev extra has it)")]

SCRIPT = SCRIPTS / "lightning_train.py"
EPOCHS = 5


def test_lightning_ddp_uses_the_launched_ranks_and_resumes_after_a_worker_kill(agents: Cluster,
                                                                               tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    agent = agents.start(["--standalone", "--nproc-per-node=2", "--max-restarts=1", f"--log-dir={log_dir}"],
                         [str(SCRIPT), "--epochs", str(EPOCHS), "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--step-seconds", "0.05"])
    for rank in (0, 1):
        wait_output(agent, rf"rank{rank}\]: global_rank {rank} world_size 2 epoch 0$", 180)
    seen = wait_output(agent, r"rank0\]: epoch 1 done$", 120)
    kill_worker(log_dir, rank=1)
    assert agent.wait(240) == 0, agent.output()[-4000:]
    (failure,) = failures(log_dir)
    assert (failure["rank"], failure["signal"]) == (1, "SIGKILL"), failure
    rest = agent.output()[seen.end():]
    epochs = [int(e) for e in re.findall(r"rank1\]: global_rank 1 world_size 2 epoch (\d+)$", rest, re.MULTILINE)]
    # "epoch 1 done" comes from the module's hook, which may run before ModelCheckpoint saved epoch 1:
    # last.ckpt holds epoch 0 at least, and resuming from it starts at epoch 1.
    assert len(epochs) == 1 and 1 <= epochs[0] < EPOCHS, rest[-3000:]
    assert "Restored all states from the checkpoint at" in rest
    assert f"rank0]: done: {EPOCHS} epochs, world_size 2" in rest
