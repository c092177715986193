"""The TorchElastic ImageNet example's pattern (ElasticDistributedSampler, a checkpoint on each node's
own disk, broadcast at start from the rank holding the newest one), unmodified, through a node join
and a node loss of a ``--nnodes=1:2`` job.

Node A trains alone; node B joins with an empty checkpoint directory and receives A's state by the
script's own broadcast; then B is lost (its agent SIGKILLed, its workers die with it) and A goes on
alone from its own newest checkpoint, to the end.  Joins and losses do not use the restart budget
(``--max-restarts=0``).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.clients.harness import SCRIPTS, wait_output
from tests.harness import Cluster, free_port, listening, wait_until

pytestmark = pytest.mark.e2e

SCRIPT = SCRIPTS / "torchelastic_imagenet.py"
EPOCHS = 12


def test_a_node_joins_receives_the_checkpoint_then_is_lost_and_the_survivor_resumes(
    agents: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    flags = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=te-imagenet", "--max-restarts=0"]

    def script(node: str) -> list[str]:
        return [str(SCRIPT), "--epochs", str(EPOCHS), "--step-seconds", "0.03",
                "--checkpoint-file", str(tmp_path / node / "checkpoint.pt")]

    a = agents.start(flags, script("a"), name="a")
    wait_until(lambda: listening(port), 60, what="node A's store")
    wait_output(a, r"rank0\]: => no workers have checkpoints, starting from epoch 0$", 120)
    wait_output(a, r"rank0\]: => saved checkpoint for epoch 0 at", 120)
    b = agents.start(flags, script("b"), name="b")
    # B joins: the group re-forms at world size 2; B's rank has no file and receives A's newest state.
    received = wait_output(b, r"rank1\]: => received checkpoint of epoch (\d+) from rank 0$", 120)
    joined_at = int(received[1])
    assert joined_at >= 0 and not (tmp_path / "b" / "checkpoint.pt").exists()
    wait_output(b, rf"rank1\]: => start_epoch: {joined_at + 1}, ", 10)
    trained = wait_output(b, r"rank1\]: epoch (\d+) world 2 ", 120)
    after_loss = len(a.output())
    b.kill(signal.SIGKILL)
    assert b.wait(10) == -signal.SIGKILL
    # A alone again: from its own checkpoint, at least as new as the epoch the pair finished.
    assert a.wait(180) == 0, agents.outputs()
    rest = a.output()[after_loss:]
    assert re.search(r"rank0\]: rank 0 of world 1, restart count [2-9]", rest), rest[-3000:]
    loaded = re.search(r"rank0\]: => loaded checkpoint file: \S+ \(epoch (\d+)\)", rest)
    assert loaded and int(loaded[1]) >= int(trained[1]) - 1, rest[-3000:]
    assert f"rank0]: epoch {EPOCHS - 1} world 1 " in rest
    assert "rank0]: done: epoch" in rest
    assert "restarts used 0/0" in rest  # the join and the loss were free
