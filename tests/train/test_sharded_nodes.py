"""Sharded states (FSDP2) across nodes under the real launcher: nodes lost and joined (issue 24).

Real agents on one machine, one per simulated node, each with its gloo worker: a lost node's shards
come back from the copies in the next node's memory, from a twin (HSDP), or from the last DCP
checkpoint when every copy of a shard was lost with it; the joiner gets its shards from the
survivors' memory.  The single-node cases are in ``test_sharded.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import uuid
from pathlib import Path

import pytest

from elastrun.shared import steplog
from tests.harness import free_port, listening
from tests.train.harness import (
    assert_exactly_once,
    committed_steps,
    digests,
    restores,
    wait_for,
)
from tests.train.harness import elastic as elastic_cmd

pytestmark = pytest.mark.e2e


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
    assert not fresh_starts_later(work / "logs"), fresh_starts_later(work / "logs")
    assert_exactly_once(out, samples, epochs)


def fresh_starts_later(log_dir: Path) -> list[str]:
    """The workers' step records (``--log-dir``) that say "restored nothing" once the job had committed a
    step: ``elastrun goodput`` would take every step before them as rolled back (a joiner under ``et.run``
    recorded one when its State, made without a model, waited for ``attach()``)."""
    logs = steplog.read_dirs([log_dir])
    began = min(r.t2 for p in logs.values() for r in p.records if r.kind == steplog.STEP)
    return [f"pid {pid}: {r}" for pid, p in logs.items() for r in p.records
            if r.kind == steplog.RESTORE and r.source is None and r.t0 > began]


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
    got = restores(out)
    logs = log_tails(work)
    assert not list(out.glob("copied.r*.jsonl")), "a copy was made although the twins hold every chunk"
    small = [v for v in got.values() if v["world_size"] == 2 and v["source"] is not None]
    assert len(small) == 2 and {v["source"] for v in small} == {"memory"}, (got, logs)
    assert {src for v in small for src in v["from"].values()} == {"memory"}, (got, logs)
    assert {v["step"] for v in small} == {before}, (before, got, logs)
    assert {v["sha256"] for v in small} <= digests(out)[before], "restored another state than the committed one"
    assert_exactly_once(out, samples, epochs)
