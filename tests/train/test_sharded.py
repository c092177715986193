"""Sharded states (FSDP2) under the real launcher: real agents, real gloo workers (issue 24).

Each rank snapshots its own shard to its node's memory; a restore at the same or another world
size gives every new rank exactly its new shards, from its node's memory, a peer's, or a DCP
checkpoint on disk; durable checkpoints are DCP checkpoints plain ``dcp.load`` reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm
from tests.train.harness import (
    REPO,
    assert_exactly_once,
    digests,
    env,
    final,
    restores,
    standalone,
)

pytestmark = pytest.mark.e2e

SAMPLES, EPOCHS = 96, 2  # 12 steps an epoch at world size 2


def test_fsdp_crashes_end_bit_for_bit_equal(work, procs, uninterrupted):
    """Crashes after a commit, before one, in the middle of a snapshot copy and after a truncated
    snapshot: each restart restores every rank's shard from node memory (the truncated one is
    detected and the step before used) and the run ends equal to an uninterrupted one."""
    crashed = work / "crashed"
    crashed.mkdir()
    crashes = ["0:1:4:after", "1:0:7:copy", "2:1:10:before", "3:0:15:after"]
    args = ["--fsdp", *(f"--crash={c}" for c in crashes), "--truncate=3:0:15"]
    rc = procs.run(standalone(crashed, args, flags=("--max-restarts=4", "--crash-loop-limit=0")), work / "run.log")
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(crashed)
    # "before" at 10: step 9, unless rank 1 died before its step-9 record landed (its copy is complete
    # by its next optimizer step, the meta renamed right after): then 8, redone exactly.
    for attempt, steps in ((1, {4}), (2, {6}), (3, {9, 8}), (4, {14})):
        assert {got[(attempt, r)]["source"] for r in (0, 1)} == {"memory"}, (attempt, got)
        [step] = {got[(attempt, r)]["step"] for r in (0, 1)}
        assert step in steps, (attempt, got)
        for rank in (0, 1):
            assert got[(attempt, rank)]["sha256"] in digests(crashed)[step], "restored state differs from the commit"
    assert final(crashed) == uninterrupted(["--fsdp"]), "parameters differ from the uninterrupted run"
    assert_exactly_once(crashed, SAMPLES, EPOCHS)


PLAIN_LOAD = """
import hashlib, json, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(5)  # other weights than the trainer's: everything must come from the checkpoint
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
for layer in (net[0], net[3], net):
    fully_shard(layer)
opt = torch.optim.AdamW(net.parameters(), lr=0.01)
sd = {"model": net.state_dict(), "optimizer": get_optimizer_state_dict(net, opt)}
dcp.load(sd, checkpoint_id=sys.argv[1])
set_optimizer_state_dict(net, opt, sd["optimizer"])
assert int(opt.state_dict()["state"][0]["step"]) == 10
h = hashlib.sha256()
for t in net.state_dict().values():
    h.update(t.full_tensor().detach().numpy().tobytes())
print(json.dumps({"sha256": h.hexdigest()}))
"""


def test_dcp_round_trip(work, procs):
    """A durable checkpoint of an FSDP2 state written by elastrun at 2 ranks is a DCP checkpoint:
    plain ``dcp.load`` reads it in a plain one-process job, and ``State.load_dcp`` (which reads any
    DCP checkpoint of ``{"model", "optimizer"}``) loads it into a fresh 3-rank job."""
    first, third = work / "first", work / "third"
    first.mkdir()
    third.mkdir()
    ck = work / "ck"
    args = ["--fsdp", "--ckpt", str(ck), "--every", "5", "--stop-at-step", "10", "--flush"]
    rc = procs.run(standalone(first, args), work / "a.log")
    assert rc == 0, (work / "a.log").read_text()[-3000:]
    step_dir = ck / f"step-{10:012d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["kind"] == "dcp" and manifest["world_size"] == 2, manifest
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"]), manifest
    committed = digests(first)[10]

    plain = warm.run([sys.executable, "-c", PLAIN_LOAD, str(step_dir)], env=env(), capture_output=True,
                     text=True, timeout=120)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout.strip().splitlines()[-1])["sha256"] in committed

    args = ["--fsdp", "--load-dcp", str(step_dir), "--stop-at-step", "1"]
    rc = procs.run(standalone(third, args, nproc=3), work / "b.log")
    assert rc == 0, (work / "b.log").read_text()[-3000:]
    got = restores(third)
    assert {(v["source"], v["world_size"]) for v in got.values()} == {(None, 3)}, got
    assert {v["sha256"] for v in got.values()} <= committed, "State.load_dcp loaded another state"


def test_unsupported_state_is_refused_in_one_line(work, procs):
    """A ZeroRedundancyOptimizer (sharded without DTensors) is refused by State with one line
    naming it; the job fails instead of snapshotting a part of the state."""
    script = work / "zero.py"
    script.write_text(
        "import torch, elastrun.train as et\n"
        "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
        "et.init_distributed()\n"
        "net = torch.nn.Linear(4, 4)\n"
        "opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)\n"
        "et.State(model=net, optimizer=opt)\n"
    )
    cmd = [sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=1", str(script)]
    rc = procs.run(cmd, work / "run.log")
    log = (work / "run.log").read_text()
    assert rc != 0, log[-3000:]
    line = ("Unsupported: elastrun.train cannot snapshot ZeroRedundancyOptimizer (its state is sharded without "
            "DTensors): use FSDP2 (fully_shard) or a plain optimizer under DDP")  # fmt: skip
    assert line in log, log[-3000:]


SWAP = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from elastrun.train.dist import forget_mesh_caches

def build():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))  # 5 and 3 rows: uneven shards
    for layer in net:
        fully_shard(layer)
    fully_shard(net)
    net.to_empty(device="cpu")
    return net

rank, d = int(sys.argv[1]), sys.argv[2]
for store, me in (("first", rank), ("second", 1 - rank)):  # the second group swaps the ranks
    dist.init_process_group("gloo", store=dist.FileStore(f"{d}/{store}", 2), rank=me, world_size=2)
    net = build()
    torch.optim.AdamW(net.parameters()).step()
    wrong = [n for n, p in net.named_parameters()
             if tuple(p.__create_chunk_list__()[0].sizes) != tuple(p.to_local().shape)]
    dist.destroy_process_group()
    forget_mesh_caches()  # what et.run does when a process leaves its group
print(json.dumps(wrong))
"""


def test_a_reform_that_swaps_ranks_describes_this_ranks_chunks(work):
    """DTensor caches sharding decisions by mesh equality, blind to which rank a process is: two
    real gloo processes that swap ranks between two groups of the same shape (what an in-process
    re-form 3 -> 2 -> 3 can do) describe their own new chunks only because the caches are cleared
    when a group is left (``dist.forget_mesh_caches``)."""
    procs = [warm.popen([sys.executable, "-c", SWAP, str(r), str(work)], env=env(), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == [], "a parameter describes another rank's chunk"


def test_sharded_module_imports_nothing_heavy():
    """``import elastrun.train`` does not import DCP (only a sharded State does)."""
    code = "import sys, elastrun.train; print('torch.distributed.checkpoint' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr


def test_dcp_storage_in_node_memory(work, procs):
    """A script that calls ``dcp.save``/``dcp.load`` itself keeps its checkpoint in node memory
    with ``et.MemoryWriter``/``et.MemoryReader``: after a crash it loads the saved state from
    memory, not from the disk checkpoint beside it."""
    out = work / "out"
    out.mkdir()
    script = Path(__file__).with_name("dcp_user.py")
    cmd = [sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(script), str(out)]  # fmt: skip
    rc = procs.run(cmd, work / "run.log")
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    loaded = json.loads((out / "load.a1.json").read_text())
    assert loaded == {"source": "memory", "sha256": json.loads((out / "saved.json").read_text())["sha256"]}, log


def test_fsdp_survivor_keeps_its_process_bit_for_bit(work, procs, uninterrupted):
    """``et.run`` with the FSDP2 model built and sharded inside ``fn`` (``state.attach``): after a
    worker crash the survivor keeps its process, re-shards a new model on the new group and loads its
    shard from node memory; the run ends equal to an uninterrupted one."""
    out = work / "out"
    out.mkdir()
    args = ["--fsdp", "--reform", "--crash=0:1:5:after"]
    rc = procs.run(standalone(out, args, flags=("--max-restarts=1",)), work / "run.log")
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(out)
    assert got[(1, 0)]["pid"] == got[(0, 0)]["pid"] and got[(1, 1)]["pid"] != got[(0, 1)]["pid"], got
    assert {(got[(1, r)]["source"], got[(1, r)]["step"]) for r in (0, 1)} == {("memory", 5)}, got
    assert "re-formed in process" in log, log[-3000:]
    assert final(out) == uninterrupted(["--fsdp"]), "parameters differ from the uninterrupted run"
    assert_exactly_once(out, SAMPLES, EPOCHS)


def test_slot_memory_is_allocated_before_the_commits_that_fill_it(tmp_path):
    """A rank's slot files (three without checkpoints) get their memory in the background as soon as
    its shard's size is known (its first commit, or a restore into a node that has only the restored
    snapshot), so the next commits write into allocated pages instead of faulting each one in
    (``slotmem.py``)."""
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("reserve_job.py")
    run = warm.run([sys.executable, str(script), str(out)], env=env(), capture_output=True, text=True,
                   cwd=REPO, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["source"] == "memory", got
    assert len(got["after_commit"]) == 3 and all(n >= got["nbytes"] for n in got["after_commit"]), got
    assert all(n >= got["nbytes"] for n in got["after_restore"]), got


ATTACH = """
import json
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import elastrun.train as et
from elastrun.train import reform, sharded

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
net = torch.nn.Sequential(torch.nn.Linear(4, 4))
fully_shard(net)
opt = torch.optim.AdamW(net.parameters())
state = et.State(model=None, optimizer=None)
link = reform._link = reform.Link()  # what et.run holds, here without an agent
link.in_fn = True
real = sharded.part_of

def part_of(*args):  # the pause lands here: the control thread's flag, then the interrupt's handler
    link.pause_pending = True
    link._on_interrupt(0, None)
    return real(*args)

sharded.part_of = part_of
try:
    state.attach(net, opt)
    raised = False
except reform.Reform:
    raised = True
print(json.dumps({"raised": raised, "model": state._model is not None, "sharded": state._sharded is not None}))
"""


def test_a_pause_during_attach_leaves_the_state_whole(work):
    """A re-form's pause that lands inside ``State.attach`` (under ``et.run``, ``fn`` attaches the model
    it built on the new group) is raised when attach has taken the model and its sharded half, never
    between them: a State with the model and not its sharded half took the replicated restore at the
    next re-form while its peers took the sharded one (mismatched collectives; both workers failed)."""
    done = warm.run([sys.executable, "-c", ATTACH], env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"raised": True, "model": True, "sharded": True}
