"""Sharded states on GPUs (issue 24, item 8): CUDA shards snapshotted to host memory, NCCL restores.

Each test starts real agents and workers (``tests/train/trainer.py --fsdp --cuda``): FSDP2 on the
rank's GPU, process group on NCCL (``et.init_distributed`` picks it when ``LOCAL_RANK`` names a GPU).
"""

from __future__ import annotations

from tests.gpu.conftest import gpu_count, gpus
from tests.train.harness import assert_exactly_once, restores, standalone
from tests.train.test_sharded import EPOCHS, SAMPLES, digests, final, lose_and_join


@gpus(1)
def test_cuda_shards_snapshot_to_host_memory_and_restore_bit_for_bit(work, procs):
    """Each rank's CUDA shard (parameters, AdamW state) is copied to its node's host memory at every
    commit; after crashes (after a commit, before one) every rank gets it back onto its GPU and the
    run ends equal to an uninterrupted one, with every sample used once."""
    n = min(gpu_count(), 2)
    clean, crashed = work / "clean", work / "crashed"
    clean.mkdir()
    crashed.mkdir()
    rc = procs.run(standalone(clean, ["--fsdp", "--cuda"], nproc=n), work / "clean.log", timeout=300)
    assert rc == 0, (work / "clean.log").read_text()[-3000:]
    args = ["--fsdp", "--cuda", "--crash=0:0:4:after", f"--crash=1:{n - 1}:7:before"]
    rc = procs.run(standalone(crashed, args, nproc=n, flags=("--max-restarts=2", "--crash-loop-limit=0")),
                   work / "run.log", timeout=300)  # fmt: skip
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(crashed)
    for attempt, step in ((1, 4), (2, 6)):
        for rank in range(n):
            assert (got[(attempt, rank)]["source"], got[(attempt, rank)]["step"]) == ("memory", step), got
            assert got[(attempt, rank)]["sha256"] in digests(crashed)[step]
    assert final(crashed) == final(clean), "parameters differ from the uninterrupted run"
    assert_exactly_once(crashed, SAMPLES, EPOCHS)


@gpus(2)
def test_nccl_restore_after_node_loss_and_join(work, procs):
    """2 → 1 → 2 nodes, one GPU each: the survivor restores from the DCP checkpoint on NCCL; the
    joiner gets its new shard from the survivor's host memory over NCCL (staged through its GPU)."""
    lose_and_join(work, procs, 2, ["--cuda"], [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}])
