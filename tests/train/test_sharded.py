"""Sharded states (FSDP2) under the real launcher: real agents, real gloo workers (issue 24).

Each rank snapshots its own shard to its node's memory; a restore at the same or another world
size gives every new rank exactly its new shards, from its node's memory, a peer's, or a DCP
checkpoint on disk; durable checkpoints are DCP checkpoints plain ``dcp.load`` reads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import warm
from tests.harness import free_port, listening
from tests.train.harness import (
    REPO,
    assert_exactly_once,
    committed_steps,
    env,
    remove_snapshot_dirs,
    restores,
    standalone,
    wait_for,
)
from tests.train.harness import elastic as elastic_cmd

pytestmark = pytest.mark.e2e

SAMPLES, EPOCHS = 96, 2  # 12 steps an epoch at world size 2


def final(out: Path) -> dict:
    return json.loads((out / "final.json").read_text())


def digests(out: Path) -> dict[int, set[str]]:
    """step -> the SHA-256s of the full parameters committed at that step (by any attempt)."""
    found: dict[int, set[str]] = {}
    for line in (out / "digest.jsonl").read_text().splitlines():
        r = json.loads(line)
        found.setdefault(r["step"], set()).add(r["sha256"])
    return found


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


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "reform"), [(3, False), (2, True)])
def test_fsdp_resize_lose_and_join_a_node(work, procs, nodes, reform):
    """N → N-1 → N nodes (one worker each).  The lost node holds primary shards, but their copies
    are in the next node's memory (2 copies, the default): the survivors go on from memory, some
    shards read from a replica, with 0 committed steps lost (the restored step is at least the newest
    one every rank's copy had finished before the loss); the joiner gets its new shard from the
    survivors' memory (peer), the survivors from their own; each restored state is exactly a
    committed one, and every sample of every epoch is used once.  With ``et.run`` the survivors
    keep their processes throughout (the model re-sharded on each new group)."""
    lose_and_join(work, procs, nodes, ["--reform"] if reform else [])


def log_tails(work: Path) -> str:
    """The end of every agent's log of a test, for its failure message, after what each agent's event
    log (``work/logs/<agent>``, where the test gave ``--log-dir``) says of its workers."""
    histories = [worker_history(d, d.name) for d in sorted((work / "logs").glob("*")) if d.is_dir()]
    return "\n".join([*histories, *(p.read_text()[-1500:] for p in sorted(work.glob("*.log")))])


def worker_history(log_dir: Path, agent: str) -> str:
    """How one agent's workers went through the rounds, from its event log (``--log-dir``): each round's
    worker PIDs and how each began (``kept``: the same process, re-formed), and every fallback's cause."""
    lines = []
    for path in sorted(log_dir.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:  # the last line of a SIGKILLed agent's log may be cut
                continue
            if e["event"] == "worker_start":
                lines.append(f"{agent}: round {e['round']}: rank {e['rank']} pid {e['pid']} ({e['start_method']})")
            elif e["event"] in ("reform_fallback", "reform_failed", "worker_exit"):
                fields = {k: v for k, v in e.items() if k not in ("ts", "node", "event")}
                lines.append(f"{agent}: {e['event']} {fields}")
    return "\n".join(lines) or f"{agent}: no events in {log_dir}"


def lose_and_join(work: Path, procs, nodes: int, extra: list[str], node_env: list[dict] | None = None) -> None:
    """Run N → N-1 → N nodes (one worker each; ``node_env[i]``: the environment of node i's agents)
    and check what ``test_fsdp_resize_lose_and_join_a_node`` says."""
    samples, epochs = 240, 2
    out = work / "out"
    out.mkdir()
    hold = work / "hold"  # while it exists, fewer than N nodes wait (in time.sleep): no race with the end
    run_id = f"shard-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--fsdp", "--samples", str(samples), "--epochs", str(epochs), "--sleep", "0.1", "--ckpt",
            str(work / "ck"), "--every", "4", "--hold-file", str(hold), "--hold-world", str(nodes), *extra]  # fmt: skip
    reform = "--reform" in extra

    def agent(name: str, node: int):
        cmd = elastic_cmd(out, port, run_id, args, flags=(f"--log-dir={work / 'logs' / name}",))
        cmd[cmd.index("--nnodes=1:2")] = f"--nnodes=1:{nodes}"
        return procs.start(cmd, work / f"{name}.log", (node_env or [{}] * nodes)[node])

    def attempts(world: int, after: int) -> list[int]:
        return [k[0] for k, v in restores(out).items() if k[0] > after and v["world_size"] == world]

    hold.touch()
    try:
        a = agent("a", 0)  # A hosts the rendezvous store: it has to outlive the others
        wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
        others = [agent(f"n{i}", i) for i in range(1, nodes)]
        wait_for(lambda: attempts(nodes, -1), 90, f"world {nodes}")
        full = max(attempts(nodes, -1))
        hold.unlink()
        wait_for(lambda: committed_steps(out), 60, f"a committed step at world size {nodes}")  # restored != stepped
        first = max(committed_steps(out))
        wait_for(lambda: max(committed_steps(out)) >= first + 6, 60, f"progress at world size {nodes}")
        wait_for(lambda: list((work / "ck").glob("step-*/manifest.json")), 60, "a complete checkpoint")
        wait_for(lambda: copied_step(out, nodes) > first, 60, "a step copied to other nodes' memory")
        safe = copied_step(out, nodes)  # committed against the loss of a node
        os.killpg(others[-1].pid, signal.SIGKILL)  # node loss: agent and worker
        others[-1].wait(10)
        wait_for(lambda: attempts(nodes - 1, full), 90, "the shrink")
        shrink = min(attempts(nodes - 1, full))
        # rank 0's restore record may come after another rank's: wait for it, then for 6 steps past it
        wait_for(lambda: (shrink, 0) in restores(out), 60, "rank 0's restore after the shrink")
        wait_for(lambda: max(committed_steps(out)) >= restores(out)[(shrink, 0)]["step"] + 6, 60, "progress")
        hold.touch()
        agent("joiner", nodes - 1)
        wait_for(lambda: attempts(nodes, shrink), 90, f"world {nodes} again")
        hold.unlink()
        assert a.wait(180) == 0, (work / "a.log").read_text()[-3000:]
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log_tails(work)}") from None
    finally:
        remove_snapshot_dirs(run_id)
    got = restores(out)
    logs = log_tails(work)
    committed = digests(out)
    small = {r: got[(shrink, r)] for r in range(nodes - 1)}
    assert {v["source"] for v in small.values()} <= {"memory", "peer"}, (got, logs)
    assert small[0]["step"] >= safe, f"committed steps lost: copies of step {safe} had finished\n{got}\n{logs}"
    read = [src for v in small.values() for src in v["from"].values()]
    assert "replica" in read or "peer replica" in read, (got, logs)  # the lost node's shards came from copies
    assert {v["sha256"] for v in small.values()} <= committed[small[0]["step"]], "shrink restored another state"
    grow_attempt = max(k[0] for k, v in got.items() if v["world_size"] == nodes)
    grown = {r: got[(grow_attempt, r)] for r in range(nodes)}
    assert grow_attempt > shrink, (got, logs)
    assert grown[nodes - 1]["source"] == "peer", (got, logs)  # the joiner has nothing in its node's memory
    assert {v["source"] for v in grown.values()} <= {"memory", "peer"}, (got, logs)
    assert {v["sha256"] for v in grown.values()} <= committed[grown[0]["step"]], "grow restored another state"
    if reform:  # node A's worker is one process from the first round of N nodes to the end
        a_pids = {k: v["pid"] for k, v in sorted(got.items()) if v["agent"] == a.pid and k[0] >= full}
        assert len(set(a_pids.values())) == 1, f"node A's worker was restarted: PIDs {a_pids}\n{logs}"
    assert_exactly_once(out, samples, epochs)


def copied_step(out: Path, ranks: int) -> int:
    """The newest step whose copy into another node's memory every rank's agent reported done
    (``copied.r<rank>.jsonl``, written by the trainer), or -1."""
    newest = []
    for r in range(ranks):
        p = out / f"copied.r{r}.jsonl"
        records = [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
        newest.append(max((c["step"] for c in records if c["ok"]), default=-1))
    return min(newest)


@pytest.mark.slow
def test_fsdp_two_nodes_lost_at_once_fall_back_to_disk(work, procs):
    """3 nodes, 2 copies of each shard, two nodes lost at once: a shard whose node and copy were both
    on them is in no memory, so the survivor restores the last DCP checkpoint and says which step
    it lost and which step it went back to; it then finishes alone, every sample once per epoch."""
    samples, epochs, nodes = 120, 1, 3
    out = work / "out"
    out.mkdir()
    hold, pause = work / "hold", work / "pause"  # while they exist: no step below world 3, none past step 6
    hold.touch()
    pause.touch()
    run_id = f"shard-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--fsdp", "--samples", str(samples), "--epochs", str(epochs), "--ckpt", str(work / "ck"), "--every",
            "4", "--hold-file", str(hold), "--hold-world", str(nodes), "--pause-file", str(pause), "--pause-after",
            "6"]  # fmt: skip

    def agent(name: str):
        cmd = elastic_cmd(out, port, run_id, args)
        cmd[cmd.index("--nnodes=1:2")] = f"--nnodes=1:{nodes}"
        return procs.start(cmd, work / f"{name}.log")

    try:
        a = agent("a")
        wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
        others = [agent(f"n{i}") for i in range(1, nodes)]
        wait_for(lambda: any(v["world_size"] == nodes for v in restores(out).values()), 90, f"world {nodes}")
        hold.unlink()
        wait_for(lambda: list((work / "ck").glob("step-*/manifest.json")), 60, "a complete checkpoint")
        wait_for(lambda: copied_step(out, nodes) >= 0, 60, "a step copied to other nodes' memory")
        # steps past the checkpoint's in memory (the workers pause at 6), so that some are lost with the nodes
        wait_for(lambda: (out / "digest.jsonl").exists() and max(digests(out)) >= 6, 60, "step 6 committed")
        for p in others:  # two nodes at once: agents and workers
            os.killpg(p.pid, signal.SIGKILL)
        for p in others:
            p.wait(10)
        pause.unlink()
        assert a.wait(180) == 0, (work / "a.log").read_text()[-3000:]
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log_tails(work)}") from None
    finally:
        remove_snapshot_dirs(run_id)
    log = (work / "a.log").read_text()
    got = restores(out)
    [alone] = [v for v in got.values() if v["world_size"] == 1 and v["source"] is not None]
    assert alone["source"] == "disk", (got, log[-3000:])
    assert alone["sha256"] in digests(out)[alone["step"]], "restored another state than the checkpoint's"
    m = re.search(r"step (\d+) is not complete in any surviving node's memory: the shards of rank\(s\) [\d, ]+ "
                  r"of step \d+ were only on nodes that are gone \(with their copies\): restoring step (\d+) "
                  r"from the checkpoint \S+ \((\d+) step\(s\) lost\)", log)  # fmt: skip
    assert m, log[-3000:]
    newest, back, lost_steps = map(int, m.groups())
    assert back == alone["step"] and newest - back == lost_steps > 0, m.group(0)
    assert_exactly_once(out, samples, epochs)


@pytest.mark.slow
def test_hsdp_twins_on_another_node_stand_in_for_copies(work, procs):
    """HSDP (2 replica groups × 2 shards) on 2 nodes × 2 workers: each rank's twin (the same
    chunks, in the other replica group) is on the other node, so no copy is made; when a node is
    lost the survivors restore every shard from their own node's memory (the lost ranks' chunks from
    their twins' files), at the last step they committed."""
    samples, epochs = 240, 1
    out = work / "out"
    out.mkdir()
    hold, pause = work / "hold", work / "pause"
    hold.touch()
    pause.touch()
    run_id = f"shard-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--fsdp", "--hsdp", "--samples", str(samples), "--epochs", str(epochs), "--hold-file", str(hold),
            "--hold-world", "4", "--pause-file", str(pause), "--pause-after", "6"]  # fmt: skip

    def agent(name: str):
        cmd = elastic_cmd(out, port, run_id, args)
        cmd[cmd.index("--nproc-per-node=1")] = "--nproc-per-node=2"
        return procs.start(cmd, work / f"{name}.log")

    try:
        a = agent("a")
        wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
        b = agent("b")
        wait_for(lambda: any(v["world_size"] == 4 for v in restores(out).values()), 90, "world 4")
        hold.unlink()
        wait_for(lambda: max(digests(out), default=0) >= 6 if (out / "digest.jsonl").exists() else False, 60,
                 "step 6")  # fmt: skip
        before = max(digests(out))
        os.killpg(b.pid, signal.SIGKILL)
        b.wait(10)
        pause.unlink()
        assert a.wait(180) == 0, (work / "a.log").read_text()[-3000:]
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log_tails(work)}") from None
    finally:
        remove_snapshot_dirs(run_id)
    got = restores(out)
    logs = log_tails(work)
    assert not list(out.glob("copied.r*.jsonl")), "a copy was made although the twins hold every chunk"
    small = [v for v in got.values() if v["world_size"] == 2 and v["source"] is not None]
    assert len(small) == 2 and {v["source"] for v in small} == {"memory"}, (got, logs)
    assert {src for v in small for src in v["from"].values()} == {"memory"}, (got, logs)
    assert {v["step"] for v in small} == {before}, (before, got, logs)
    assert {v["sha256"] for v in small} <= digests(out)[before], "restored another state than the committed one"
    assert_exactly_once(out, samples, epochs)


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
