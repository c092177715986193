"""In-process re-forms (``elastrun.train.run``) under the real launcher: real agents, real gloo workers.

Survivors keep their process (same PID) across a worker crash, a node loss and a node join; the
run still ends bit-for-bit equal to an uninterrupted one and uses every sample once per epoch.
Workers that cannot leave their group in time fall back to today's restart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

from elastrun.shared.sockets import socket_inodes
from tests.harness import free_port, listening
from tests.train.harness import (
    PRELOAD,
    assert_exactly_once,
    committed_steps,
    elastic,
    final,
    restores,
    standalone,
    wait_for,
)

pytestmark = pytest.mark.e2e

SAMPLES = 96


def events(log: Path, kind: str) -> list[dict]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{kind}"' in line:
            record = json.loads(line)
            if record.get("event") == kind:
                found.append(record)
    return found


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def queued_bytes(pid: int) -> int:
    """Bytes that ``pid``'s TCP connections have written and their peers have not yet taken."""
    inodes = socket_inodes(pid)
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[9]) in inodes:
                total += int(fields[4].split(":")[0], 16)
    return total


def test_worker_crashes_survivor_keeps_process_bit_for_bit(work, procs, uninterrupted):
    """Two crashes in a row: each time the other rank keeps its PID; a clean survivor rolls back
    from its own objects ("live"), a torn one (crash after the survivor's optimizer step) from
    node memory; the end equals an uninterrupted run."""
    expected = uninterrupted(["--ddp"])
    out = work / "out"
    out.mkdir()
    args = ["--ddp", "--reform", "--crash=0:1:5:after", "--crash=1:0:9:before"]
    flags = ("--max-restarts=2", "--crash-loop-limit=0", "--event-log-stdout")
    rc = procs.run(standalone(out, args, flags=flags), work / "run.log")
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(out)
    assert got[(1, 0)]["pid"] == got[(0, 0)]["pid"], got  # rank 0 survived the first crash
    assert got[(1, 0)]["source"] == "live" and got[(1, 0)]["step"] == 5, got
    assert got[(1, 1)]["pid"] != got[(0, 1)]["pid"] and got[(1, 1)]["source"] == "memory", got
    assert got[(2, 1)]["pid"] == got[(1, 1)]["pid"], got  # rank 1 survived the second crash
    assert got[(2, 0)]["pid"] != got[(1, 0)]["pid"], got
    # "before": step 9 never committed.  Step 8 is restored unless rank 0 (the node's snapshot writer)
    # died before step 8's snapshot was published (its background copy finishes by the next optimizer
    # step; its record can land just after): then 7, redone exactly.  Either way both ranks agree.
    steps = {got[(2, r)]["step"] for r in (0, 1)}
    assert steps in ({8}, {7}), got
    reforms = events(work / "run.log", "reform")
    assert [r["kept"] for r in reforms] == [[0], [1]], reforms
    assert final(out) == expected, "parameters differ from the uninterrupted run"
    assert_exactly_once(out, SAMPLES, 2)


def test_with_spaced_snapshots_the_survivors_live_step_is_sent_to_the_new_rank(work, procs, uninterrupted):
    """Snapshots every 4 commits (as the default spacing makes them for a state whose copy costs the
    step): rank 1 crashes after committing step 6, whose newest snapshot is step 4.  The survivor holds
    step 6 live and sends it to the new rank ("peer"), so nothing is redone; the end equals an
    uninterrupted run."""
    expected = uninterrupted(["--ddp"])
    out = work / "out"
    out.mkdir()
    args = ["--ddp", "--reform", "--snapshot-every", "4", "--crash=0:1:6:after"]
    rc = procs.run(standalone(out, args, flags=("--max-restarts=1",)), work / "run.log")
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(out)
    assert got[(1, 0)]["pid"] == got[(0, 0)]["pid"] and got[(1, 0)]["source"] == "live", got
    assert got[(1, 1)]["pid"] != got[(0, 1)]["pid"], got
    assert {got[(1, r)]["step"] for r in (0, 1)} == {6}, got
    assert got[(1, 1)]["source"] == "peer", got
    assert final(out) == expected, "parameters differ from the uninterrupted run"
    assert_exactly_once(out, SAMPLES, 2)


def test_spawned_workers_reform_too(work, procs, uninterrupted):
    """``--start-method spawn`` (no warm pool): the survivor keeps its process, the restarted rank is
    exec'd, and the result is still bit-for-bit the uninterrupted one."""
    expected = uninterrupted([])
    out = work / "out"
    out.mkdir()
    flags = ("--max-restarts=1", "--start-method=spawn", f"--log-dir={work / 'logs'}", "--tee=3")
    rc = procs.run(standalone(out, ["--reform", "--crash=0:0:6:after"], flags=flags), work / "run.log", timeout=180)
    log = (work / "run.log").read_text()
    assert rc == 0, log[-3000:]
    got = restores(out)
    assert got[(1, 1)]["pid"] == got[(0, 1)]["pid"] and got[(1, 1)]["source"] == "live", got
    # The kept rank still writes to its first attempt's files; the new attempt links to them.
    [kept_log] = (work / "logs").rglob("attempt_1/rank_1/stderr.log")
    assert kept_log.is_symlink() and kept_log.resolve() == kept_log.parents[1].parent.joinpath(
        "attempt_0", "rank_1", "stderr.log").resolve(), kept_log
    assert not kept_log.parents[1].joinpath("rank_0", "stderr.log").is_symlink()  # the restarted rank's own
    assert got[(1, 0)]["pid"] != got[(0, 0)]["pid"], got
    assert "re-formed in process" in log, log[-3000:]
    assert final(out) == expected


def test_survivor_leaves_collective_blocked_on_stopped_peer(work, procs, uninterrupted):
    """A SIGSTOPped rank blocks the other in a collective; the hang detector dumps and kills the
    stopped one at once (the other, silent too, is not blamed); the blocked survivor leaves its
    collective (its group's connections are shut down) and keeps its process; the job ends equal
    to an uninterrupted one."""
    expected = uninterrupted(["--ddp"])
    out = work / "out"
    out.mkdir()
    flags = ("--max-restarts=1", "--hang-timeout=2")
    agent = procs.start(standalone(out, ["--ddp", "--reform", "--sleep", "0.05"], flags=flags), work / "run.log")
    wait_for(lambda: len(committed_steps(out)) >= 4, 60, "4 steps")
    victim = restores(out)[(0, 1)]["pid"]
    os.kill(victim, signal.SIGSTOP)
    assert agent.wait(120) == 0, (work / "run.log").read_text()[-3000:]
    log = (work / "run.log").read_text()
    got = restores(out)
    assert got[(1, 0)]["pid"] == got[(0, 0)]["pid"], (got, log[-3000:])
    assert got[(1, 1)]["pid"] != victim, got
    # Both ranks are silent; only the stopped one (frozen) is judged hung, dumped and replaced.
    assert log.count(" is hung: ") == 1 and "rank 1 is hung: " in log, log[-3000:]
    assert "[node0 rank1]: Fatal Python error: Aborted" in log, log[-3000:]
    assert "re-formed in process" in log, log[-3000:]
    assert final(out) == expected


def test_a_hang_across_two_nodes_blames_one_rank_and_the_blocked_peer_keeps_its_process(work, procs):
    """Two agents, one gloo worker each; rank 1 is SIGSTOPped.  Rank 0, blocked in a collective on
    it, falls silent too, but only rank 1's agent reports a hang: its worker is frozen, so it claims
    the round's hang first; rank 0's agent finds that claim and ends its group as for a change
    elsewhere.  One rank is blamed (one ``hang_detected``, one failure recorded), rank 1 is dumped,
    rank 0 keeps its process (no wait for rank 1 to answer a pause it cannot), and the job ends well."""
    out = work / "out"
    out.mkdir()
    run_id = f"hang-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--ddp", "--reform", "--sleep", "0.05"]
    flags = ("--hang-timeout=2", "--event-log-stdout")
    agents = [procs.start(elastic(out, port, run_id, args, nnodes="2", flags=flags), work / "a.log")]
    wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
    agents.append(procs.start(elastic(out, port, run_id, args, nnodes="2", flags=flags), work / "b.log"))
    wait_for(lambda: len(committed_steps(out)) >= 4, 90, "4 steps at world size 2")
    victim = restores(out)[(0, 1)]["pid"]
    os.kill(victim, signal.SIGSTOP)
    for agent, name in zip(agents, ("a.log", "b.log"), strict=True):
        assert agent.wait(120) == 0, (work / name).read_text()[-3000:]
    logs = {name: work / name for name in ("a.log", "b.log")}
    text = "\n".join(path.read_text()[-3000:] for path in logs.values())
    hangs = [e for path in logs.values() for e in events(path, "hang_detected")]
    assert [e["rank"] for e in hangs] == [1], (hangs, text)
    # Rank 0's agent ends its group as for a change elsewhere: it found rank 1's claim (``waits on
    # the hang of rank 1``) or, first, the new round rank 1's agent asked for.
    assert [e["round"] for path in logs.values() for e in events(path, "restart")] == [0], text
    assert sum(path.read_text().count(" is hung: ") for path in logs.values()) == 1, text
    assert any("rank1]: Fatal Python error: Aborted" in path.read_text() for path in logs.values()), text
    assert not [e for path in logs.values() for e in events(path, "reform_fallback")], text
    got = restores(out)
    assert got[(1, 0)]["pid"] == got[(0, 0)]["pid"] and got[(1, 1)]["pid"] != victim, got


def test_survivor_that_cannot_leave_is_restarted(work, procs, uninterrupted):
    """Fallback: a survivor that does not answer the pause (SIGSTOPped) within --reform-timeout is
    killed and restarted as today; the job still ends bit-for-bit equal to an uninterrupted run."""
    expected = uninterrupted(["--ddp"])
    out = work / "out"
    out.mkdir()
    flags = ("--max-restarts=1", "--reform-timeout=1")
    agent = procs.start(standalone(out, ["--ddp", "--reform", "--sleep", "0.05"], flags=flags), work / "run.log")
    wait_for(lambda: len(committed_steps(out)) >= 4, 60, "4 steps")
    first = restores(out)
    os.kill(first[(0, 0)]["pid"], signal.SIGSTOP)
    wait_for(lambda: stopped(first[(0, 0)]["pid"]), 10, "rank 0 stopped")
    os.kill(first[(0, 1)]["pid"], signal.SIGKILL)
    assert agent.wait(120) == 0, (work / "run.log").read_text()[-3000:]
    log = (work / "run.log").read_text()
    got = restores(out)
    assert {got[(1, r)]["pid"] for r in (0, 1)}.isdisjoint({first[(0, r)]["pid"] for r in (0, 1)}), got
    assert {got[(1, r)]["source"] for r in (0, 1)} == {"memory"}, got
    assert "re-formed in process" not in log, log[-3000:]
    # The fallback says what the kernel saw of the silent worker's threads: its main thread stopped.
    assert "no answer to the pause within --reform-timeout (1 s); its threads then: main T" in log, log[-3000:]
    assert final(out) == expected
    assert_exactly_once(out, SAMPLES, 2)


def test_survivor_stuck_in_a_lost_send_says_so_and_is_restarted_at_once(work, procs):
    """gloo never ends a send whose bytes wait in its write queue when the connection fails
    (tests/train/lost_send.py sets one up: rank 1 stops reading, then dies).  The survivor cannot
    leave its group; it tells its agent so itself (elastrun.train.stuck) about 1 s after the pause,
    where the agent alone would wait out --reform-timeout (30 s here) before restarting it."""
    out = work / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "elastrun", "--standalone", "--nproc-per-node=2", PRELOAD, "--max-restarts=1",
           "--reform-timeout=30", str(Path(__file__).with_name("lost_send.py")), str(out)]
    agent = procs.start(cmd, work / "run.log")
    wait_for(lambda: (out / "sending").exists() and (out / "attempted.r1").exists(), 60, "rank 0 sending")
    victim, sender = int((out / "attempted.r1").read_text()), int((out / "sending").read_text())
    wait_for(lambda: stopped(victim), 10, "rank 1 stopped before reading")
    wait_for(lambda: queued_bytes(sender) > 1 << 20, 10, "rank 0's send queued behind the stopped reader")
    os.kill(victim, signal.SIGKILL)
    assert agent.wait(60) == 0, (work / "run.log").read_text()[-3000:]
    log = (work / "run.log").read_text()
    assert f"rank 0 (pid {sender}) is restarted instead of re-formed in its process: could not leave its group: " \
           "stuck in send (distributed_c10d.py:" in log, log[-3000:]
    assert "no answer to the pause" not in log, log[-3000:]


def test_node_loss_and_join_keep_the_survivor_process(work, procs):
    """2 → 1 → 2 nodes: the surviving node's worker keeps its PID throughout, the joiner gets the state
    from it (the survivor, waiting in ``time.sleep``, rolls back from its own objects); every sample
    is used once per epoch.

    Node B is killed while both ranks wait between steps.  Killed in the middle of a collective, it can
    leave A's worker in a send that gloo never ends, which no process can leave (the worker says so
    and is restarted: ``test_survivor_stuck_in_a_lost_send_says_so_and_is_restarted_at_once``)."""
    samples, epochs = 240, 2
    out = work / "out"
    out.mkdir()
    hold = work / "hold"  # while it exists, A alone waits (in time.sleep) for a joiner: no race with the end
    pause = work / "pause"  # while it exists, each rank waits after committing the step it names
    run_id = f"reform-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--samples", str(samples), "--epochs", str(epochs), "--sleep", "0.1", "--reform", "--hold-file", str(hold),
            "--pause-file", str(pause)]

    def paused_at() -> set[str]:
        return {p.read_text() for p in out.glob("paused.r*")} if len(list(out.glob("paused.r*"))) == 2 else set()
    hold.touch()
    a = procs.start(elastic(out, port, run_id, args), work / "a.log")
    wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
    # A's first round, alone, is one of the four attempts its process must run: B joins after it
    wait_for(lambda: any(v["world_size"] == 1 for v in restores(out).values()), 60, "A training alone")
    b = procs.start(elastic(out, port, run_id, args), work / "b.log")
    wait_for(lambda: any(v["world_size"] == 2 for v in restores(out).values()), 60, "world 2")
    grown = max(k[0] for k, v in restores(out).items() if v["world_size"] == 2)
    hold.unlink()
    # A held at world size 1 without stepping: the world-2 restore comes before any committed step.
    wait_for(lambda: committed_steps(out), 60, "a committed step at world size 2")
    first = max(committed_steps(out))
    wait_for(lambda: max(committed_steps(out)) >= first + 6, 60, "progress at world size 2")
    # both ranks wait after the same step, a few steps ahead (a file that appeared between their checks
    # of one step would stop one of them there, the other in that next step's collective)
    (work / "pause.new").write_text(str(max(committed_steps(out)) + 3))
    os.rename(work / "pause.new", pause)
    wait_for(lambda: len(paused_at()) == 1, 60, "both ranks waiting after the same step")
    os.killpg(b.pid, signal.SIGKILL)  # node loss: agent and worker
    b.wait(10)
    wait_for(lambda: any(k[0] > grown and v["world_size"] == 1 for k, v in restores(out).items()), 60, "world 1")
    pause.unlink()
    shrink = max(k[0] for k, v in restores(out).items() if v["world_size"] == 1)
    wait_for(lambda: max(committed_steps(out)) >= restores(out)[(shrink, 0)]["step"] + 6, 60, "progress at 1")
    hold.touch()
    procs.start(elastic(out, port, run_id, args), work / "b2.log")
    wait_for(lambda: any(k[0] > shrink and v["world_size"] == 2 for k, v in restores(out).items()), 90, "world 2")
    hold.unlink()
    assert a.wait(150) == 0, (work / "a.log").read_text()[-3000:]
    got = restores(out)
    logs = "\n".join((work / n).read_text()[-1500:] for n in ("a.log", "b.log", "b2.log"))
    a_pid = got[(shrink, 0)]["pid"]
    assert got[(shrink, 0)]["source"] == "live", (got, logs)  # the loss found it waiting after a commit
    grow = max(k[0] for k, v in got.items() if v["world_size"] == 2)
    assert grow > shrink, (got, logs)
    at_grow = sorted((v["pid"] == a_pid, v["source"]) for k, v in got.items() if k[0] == grow)
    assert at_grow == [(False, "peer"), (True, "live")], (got, logs)
    # A's one worker process ran every attempt A took part in: first round, growth, shrink, growth.
    assert sum(1 for v in got.values() if v["pid"] == a_pid) >= 4, (got, logs)
    assert_exactly_once(out, samples, epochs)


def test_a_join_lets_the_survivor_finish_its_step_and_leave_at_its_commit(work, procs):
    """A trains alone (1:2) and B joins.  The group is whole, so A's worker, asked to pause for the
    joiner, finishes the step it is in and leaves its group at the end of that step's commit
    (elastrun/train/commit_pause.py): nothing of the step is thrown away, the worker keeps its
    objects ("live") and every sample is used once per epoch."""
    samples, epochs = 480, 2  # 120 steps of about 0.1 s alone: B's start-up takes a few seconds
    out = work / "out"
    out.mkdir()
    run_id = f"reform-join-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--samples", str(samples), "--epochs", str(epochs), "--sleep", "0.1", "--reform"]
    a = procs.start(elastic(out, port, run_id, args, flags=("--event-log-stdout",)), work / "a.log")
    wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
    wait_for(lambda: len(committed_steps(out)) >= 5, 60, "A stepping alone")
    b = procs.start(elastic(out, port, run_id, args), work / "b.log")
    wait_for(lambda: any(v["world_size"] == 2 for v in restores(out).values()), 90, "world 2")
    assert a.wait(150) == 0, (work / "a.log").read_text()[-3000:]
    assert b.wait(30) == 0, (work / "b.log").read_text()[-3000:]
    got = restores(out)
    logs = "\n".join((work / n).read_text()[-2000:] for n in ("a.log", "b.log"))
    grow = min(k[0] for k, v in got.items() if v["world_size"] == 2)
    a_pid = got[(0, 0)]["pid"]
    at_grow = {v["pid"] == a_pid: v for k, v in got.items() if k[0] == grow}
    assert at_grow[True]["source"] == "live" and at_grow[False]["source"] == "peer", (got, logs)
    assert at_grow[True]["step"] >= 5, (got, logs)
    reforms = events(work / "a.log", "reform")
    assert [(r["kept"], r["at_commit"]) for r in reforms] == [([0], True)], (reforms, logs)
    assert "left its group at the end of a commit()" in (work / "a.log").read_text(), logs
    assert_exactly_once(out, samples, epochs)


def test_a_node_preempted_under_run_leaves_the_survivor_at_its_last_commit(work, procs):
    """A and B train (1:2); B's agent is SIGTERMed.  B's worker checkpoints at its next commit and
    exits; that commit tells every rank (its flags), so A's worker leaves its group at the end of the
    same commit instead of waiting in its next collective for a rank that is gone: it keeps that step
    and its objects ("live"), and every sample is used once per epoch."""
    samples, epochs = 480, 2
    out, ck = work / "out", work / "ck"
    out.mkdir()
    run_id = f"reform-preempt-{uuid.uuid4().hex[:8]}"
    port = free_port()
    args = ["--samples", str(samples), "--epochs", str(epochs), "--sleep", "0.1", "--reform", "--ckpt", str(ck)]
    a = procs.start(elastic(out, port, run_id, args, flags=("--event-log-stdout",)), work / "a.log")
    wait_for(lambda: listening(port), 60, "agent A hosting the rendezvous store")
    b = procs.start(elastic(out, port, run_id, args), work / "b.log")
    wait_for(lambda: any(v["world_size"] == 2 for v in restores(out).values()), 90, "world 2")
    two = min(k[0] for k, v in restores(out).items() if v["world_size"] == 2)
    wait_for(lambda: len([s for s in committed_steps(out).values() if s[0]["attempt"] >= two]) >= 5, 60,
             "steps at world size 2")
    os.kill(b.pid, signal.SIGTERM)
    assert b.wait(60) == 128 + signal.SIGTERM, (work / "b.log").read_text()[-3000:]  # as torchrun
    assert a.wait(150) == 0, (work / "a.log").read_text()[-3000:]
    got = restores(out)
    logs = "\n".join((work / n).read_text()[-2000:] for n in ("a.log", "b.log"))
    stop = json.loads((out / "preempted.r1.json").read_text())["step"]
    one = min(k[0] for k, v in got.items() if k[0] > two and v["world_size"] == 1)
    assert got[(one, 0)]["pid"] == got[(two, 0)]["pid"], (got, logs)
    assert got[(one, 0)]["source"] == "live" and got[(one, 0)]["step"] == stop, (got, stop, logs)
    reforms = events(work / "a.log", "reform")
    assert [r["at_commit"] for r in reforms] == [True], (reforms, logs)
    assert_exactly_once(out, samples, epochs)


def test_preemption_under_run_checkpoints_and_exits(work, procs):
    """SIGTERM to the agent with ``et.run``: as without it, every rank stops at the same step, a
    durable checkpoint of that step is written, and the job exits without a traceback."""
    out, ck = work / "out", work / "ck"
    out.mkdir()
    args = ["--reform", "--ckpt", str(ck), "--every", "5", "--sleep", "0.2"]
    agent = procs.start(standalone(out, args), work / "run.log")
    wait_for(lambda: len(committed_steps(out)) >= 5, 60, "5 steps")
    os.kill(agent.pid, signal.SIGTERM)
    agent.wait(60)
    log = (work / "run.log").read_text()
    stops = {json.loads((out / f"preempted.r{r}.json").read_text())["step"] for r in (0, 1)}
    assert len(stops) == 1, log[-3000:]
    assert (ck / f"step-{stops.pop():012d}" / "manifest.json").exists(), sorted(p.name for p in ck.iterdir())
    assert "Traceback" not in log, log[-3000:]
