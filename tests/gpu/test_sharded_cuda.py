"""Sharded states on GPUs (issue 24, item 8): CUDA shards snapshotted to host memory, NCCL restores.

Each test starts real agents and workers (``tests/train/trainer.py --fsdp --cuda``): FSDP2 on the
rank's GPU, process group on NCCL (``et.init_distributed`` picks it when ``LOCAL_RANK`` names a GPU).
"""

from __future__ import annotations

import pytest

from tests.gpu.conftest import gpu_count, gpus
from tests.train.harness import assert_exactly_once, digests, final, restores, standalone
from tests.train.test_sharded import EPOCHS, SAMPLES
from tests.train.test_sharded_nodes import lose_and_join

pytestmark = pytest.mark.e2e


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
    """2 → 1 → 2 nodes, one GPU each, NCCL: the survivor restores the lost node's shard from the
    replica in its own node's memory (0 committed steps lost); the joiner gets its new shard from
    the survivor's snapshot server (staged through a host buffer onto its GPU)."""
    lose_and_join(work, procs, 2, ["--cuda"], [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}])


_SERVER_INTO_CUDA = """
import dataclasses, sys, tempfile
from pathlib import Path
import torch
from elastrun.agent.snapserver import SnapshotServer
from elastrun.train.sharded import slots
from elastrun.train.sharded.fetch import FileRef, ServerTransport, Want
from elastrun.train.sharded.layout import lay_out

d = Path(tempfile.mkdtemp(dir="/dev/shm"))
data = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8)  # 5 lane buffers and more
entries, _, size = lay_out({"w": data})
mem = slots.ShardSlots(d, "job", 0)
slot, buf, view = mem.begin(size)
buf[: data.numel()].copy_(data)
del buf
view.release()
crc = mem.publish(slot, {"step": 1, "world_size": 1, "rank": 0, "nbytes": size,
                         "entries": [dataclasses.astuple(e) for e in entries], "skeleton": b""})
server = SnapshotServer(d, None, ("127.0.0.1", 0), "127.0.0.1")
server.start()
cut = (24 << 20) + 12345  # two GPU ranges (one not a multiple of a lane's buffer) and one host range
first = torch.zeros(cut, dtype=torch.uint8, device="cuda")
second = torch.zeros(data.numel() - cut, dtype=torch.uint8, device="cuda")
host = torch.zeros(1 << 20, dtype=torch.uint8)
ref = FileRef(0, 1)
transport = ServerTransport({1: server.address}, {(1, ref): ("", mem.name(slot), crc)}, None)
transport.fetch([Want(1, ref, 0, cut, first), Want(1, ref, cut, data.numel() - cut, second),
                 Want(1, ref, 7, 1 << 20, host)], lambda ref: None)
assert torch.equal(first.cpu(), data[:cut]) and torch.equal(second.cpu(), data[cut:]), "bytes differ"
assert torch.equal(host, data[7 : 7 + (1 << 20)]), "host bytes differ"
print(f"{transport.received / transport.seconds / 1e9:.1f} GB/s from the server onto the GPU", file=sys.stderr)
server.close()
mem.close()
print("ok")
"""


@gpus(1)
def test_snapshot_server_ranges_land_in_cuda_tensors(work):
    """Ranges fetched from a snapshot server into CUDA destinations land in one host buffer, then go
    onto the GPU through the page-locked lanes, bit-for-bit, beside a host destination (in a child
    process: pytest itself never initialises CUDA)."""
    import subprocess
    import sys

    from tests.train.harness import env

    out = subprocess.run([sys.executable, "-c", _SERVER_INTO_CUDA], env=env(), capture_output=True, text=True,
                         timeout=120, cwd=work)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
