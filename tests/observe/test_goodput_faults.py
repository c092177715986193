"""Faults across nodes: which agents' events make one fault, when it came, and what each slot paid.

Histories of two to four nodes written by hand, as test_goodput_compute.py writes one node's (its
helpers: the clock origin ``T`` and the step records): a hung rank, a crash seen from its peer, a
join, pre-emptions.  Each case is one rule of docs/observe.md ("Faults") that a real job once got
wrong, checked to the millisecond.
"""

from __future__ import annotations

import pytest

from elastrun.observe.goodput import compute
from elastrun.shared.steplog import ProcessLog
from tests.observe.test_goodput_compute import T, restore, step

pytestmark = pytest.mark.unit

def on(node: str, t: float, event: str, **fields) -> dict:
    return {"ts": T + t, "node": node, "event": event, **fields}


def two_nodes(names: tuple[str, str] = ("host-a", "host-b"), pids: tuple[int, int] = (100, 200)) -> list[dict]:
    """Nodes a and b, one worker each, in round 0 from 1.0."""
    events = []
    for rank, (node, pid) in enumerate(zip(names, pids, strict=True)):
        events += [on(node, 0.0, "agent_start", run_id="job", nproc=1, pid=pid // 100, hostname=node),
                   on(node, 0.5, "round_start"),
                   on(node, 1.0, "round_closed", round=0, generation=0, world_size=2, members=list(names)),
                   on(node, 1.0, "worker_start", round=0, generation=0, rank=rank, local_rank=0, pid=pid,
                      start_method="fork")]
    return events


def round_one(at: float) -> list[dict]:
    """Both nodes of :func:`two_nodes` in round 1 from ``at``, their workers done at 9.0."""
    events = []
    for rank, (node, pid) in enumerate((("host-a", 101), ("host-b", 201))):
        events += [on(node, at, "round_closed", round=1, generation=1, world_size=2, members=["host-a", "host-b"]),
                   on(node, at, "worker_start", round=1, generation=1, rank=rank, local_rank=0, pid=pid,
                      start_method="fork"),
                   on(node, 9.0, "worker_exit", round=1, pid=pid, local_rank=0, exitcode=0, signal=None),
                   on(node, 9.5, "agent_exit", exitcode=0)]
    return events


#: Steps of 0.5 s from 1.0, the last ending at 5.0.
STEPS_TO_5 = [step(n, 1.0 + 0.5 * n, 1.4 + 0.5 * n, 1.5 + 0.5 * n) for n in range(8)]


def cut_off_by_a_peer(*at_b: dict) -> list[dict]:
    """Round 0 of :func:`two_nodes` ends with host-a's worker failing of rank 1's closed connection
    (``peer_error``, alive until 5.6) and host-b's agent stopping its group for the new round (with
    ``at_b``, its own events then)."""
    return [*two_nodes(),
            on("host-a", 5.65, "worker_exit", round=0, pid=100, local_rank=0, rank=0, exitcode=1, signal=None,
               alive_at=T + 5.6),
            on("host-a", 5.65, "worker_failure", round=0, rank=0, local_rank=0, exitcode=1, signal=None,
               peer_error=True),
            on("host-a", 5.7, "round_start", after=0),
            on("host-b", 5.7, "restart", round=0, reason="another node asked for a new round"),
            *at_b,
            on("host-b", 5.7, "round_start", after=0)]


def rank_1_hangs(detected: float, formed: float) -> list[dict]:
    """:func:`two_nodes`, whose rank 1 (host-b, pid 200) is found hung at ``detected`` (its agent kills it
    with SIGABRT); both nodes form round 1 at ``formed`` (pids 101 and 201), done at 10.0."""
    events = [*two_nodes(),
              on("host-b", detected, "hang_detected", round=0, rank=1, local_rank=0, reason="no heartbeat for 2.0 s"),
              on("host-b", detected + 0.04, "worker_exit", pid=200, local_rank=0, exitcode=None, signal="SIGABRT"),
              on("host-b", detected + 0.04, "worker_failure", round=0, rank=1, local_rank=0, exitcode=None,
                 signal="SIGABRT"),
              on("host-a", detected + 0.05, "restart", round=0, reason="another node asked for a new round"),
              on("host-b", detected + 0.05, "round_start", after=0),
              on("host-a", detected + 0.1, "round_start", after=0)]
    for rank, (node, pid) in enumerate((("host-a", 101), ("host-b", 201))):
        events += [on(node, formed, "round_closed", round=1, generation=1, world_size=2, members=["host-a", "host-b"]),
                   on(node, formed, "worker_start", round=1, generation=1, rank=rank, local_rank=0, pid=pid,
                      start_method="fork"),
                   on(node, 10.0, "worker_exit", pid=pid, local_rank=0, exitcode=0, signal=None),
                   on(node, 10.5, "agent_exit", exitcode=0)]
    return events


def test_a_commit_that_a_hung_peer_held_up_is_the_hangs_time_not_commit() -> None:
    """Rank 1 stops (SIGSTOP) after committing step 3 at 5.0; its agent detects the hang at 7.0.

    Rank 0 had begun step 4 just before (4.99), called commit() at 5.5 and was held there by the
    stopped peer until the hung worker, woken (SIGCONT) to dump its stacks, let the collective through
    (7.02: seen with three gloo ranks; in a job of the accuracy test, the hung worker's own commit).  From the
    fault on, both slots wait on the hang: 2 x 2 s of hang, and of rank 0's commit only what lies
    before the fault is commit.  The new group restores step 4, so rank 0's step 4 is kept.
    """
    events = rank_1_hangs(7.0, 7.3)
    before = [restore(0, 1.5, 2.0, None), step(1, 2.0, 2.9, 3.0), step(2, 3.0, 3.9, 4.0)]
    after = [restore(4, 7.5, 7.8, "memory"), step(5, 7.8, 8.7, 8.8), step(6, 8.8, 9.7, 9.8)]
    logs = {("host-a", 100): ProcessLog(100, "host-a", T + 1, [*before, step(3, 4.0, 4.9, 4.99),
                                                               step(4, 4.99, 5.5, 7.02)]),
            ("host-b", 200): ProcessLog(200, "host-b", T + 1, [*before, step(3, 4.0, 4.9, 5.0)]),
            ("host-a", 101): ProcessLog(101, "host-a", T + 7.3, after),
            ("host-b", 201): ProcessLog(201, "host-b", T + 7.3, after)}
    gp = compute(events, logs)
    (fault,) = gp.faults
    assert (fault.kind, fault.at, fault.detected) == ("hang", pytest.approx(T + 5.0, abs=0.01),
                                                      pytest.approx(T + 7.0, abs=0.01))
    assert gp.badput["hang"] == pytest.approx(2 * 2.0)
    # commit: 3 x 0.1 on rank 1, 0.1 + 0.1 + 0.09 on rank 0 before the fault, 2 x 2 x 0.1 after it
    assert gp.badput["commit"] == pytest.approx(0.3 + 0.29 + 0.4)
    assert gp.good == pytest.approx(2.7 + (3.0 - 0.29) + 2 * 2 * 0.9)  # rank 0's steps 1-4 up to the fault
    assert "commit" not in fault.cost
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)
    assert gp.wall_good + sum(gp.wall_badput.values()) == pytest.approx(gp.wall)


def test_a_hung_rank_that_took_part_in_a_commit_its_peer_recorded_hung_after_it() -> None:
    """Rank 1's last record is step 3 (ending 5.0), but rank 0 recorded step 4 (5.0 to 5.5): its commit's
    all-reduce had rank 1 in it, so rank 1 was stopped after that (between the all-reduce and its record), not
    at 5.0.  The hang runs from 5.5 to its detection (7.5) on both slots; step 4, rolled back by the new
    group's restore of step 3, is redone on rank 0, and rank 1's 5.0 to 5.5 is the step the hang cut short.
    """
    events = rank_1_hangs(7.5, 7.8)
    before = [restore(0, 1.5, 2.0, None), step(1, 2.0, 2.9, 3.0), step(2, 3.0, 3.9, 4.0), step(3, 4.0, 4.9, 5.0)]
    after = [restore(3, 8.0, 8.3, "memory"), step(4, 8.3, 9.2, 9.3)]
    logs = {("host-a", 100): ProcessLog(100, "host-a", T + 1, [*before, step(4, 5.0, 5.4, 5.5)]),
            ("host-b", 200): ProcessLog(200, "host-b", T + 1, before),
            ("host-a", 101): ProcessLog(101, "host-a", T + 7.8, after),
            ("host-b", 201): ProcessLog(201, "host-b", T + 7.8, after)}
    gp = compute(events, logs)
    (fault,) = gp.faults
    assert (fault.kind, fault.at, fault.detected) == ("hang", pytest.approx(T + 5.5, abs=1e-3),
                                                      pytest.approx(T + 7.5, abs=1e-3))
    assert gp.badput["hang"] == pytest.approx(2 * 2.0)
    assert gp.badput["redone"] == pytest.approx(0.5 + 0.5)
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)


def three_in_round_one() -> list[dict]:
    """Nodes a, b and c in round 1 from 5.3, their workers done at 6.0 (after c joined)."""
    events = []
    for rank, node in enumerate(("host-a", "host-b", "host-c")):
        events += [on(node, 5.3, "round_closed", round=1, generation=1, world_size=3,
                      members=["host-a", "host-b", "host-c"]),
                   on(node, 5.3, "worker_start", round=1, generation=1, rank=rank, local_rank=0, pid=300 + rank,
                      start_method="fork"),
                   on(node, 6.0, "worker_exit", pid=300 + rank, local_rank=0, exitcode=0, signal=None),
                   on(node, 6.0, "agent_exit", exitcode=0)]
    return events


def test_a_worker_killed_by_a_joins_restart_does_not_make_the_join_a_crash() -> None:
    """Node a reads that node c waits to join and stops its worker (5.0); node b's worker dies of the
    broken collective (5.03) before b's agent reads the news itself.  One fault: the join."""
    events = [*two_nodes(),
              on("host-c", 4.5, "agent_start", run_id="job", nproc=1, pid=3, hostname="host-c"),
              on("host-c", 4.6, "round_start"),
              on("host-a", 5.0, "nodes_waiting", round=0, count=1),
              on("host-a", 5.0, "restart", round=0, reason="1 node(s) waiting to join"),
              on("host-b", 5.03, "worker_exit", pid=200, local_rank=0, exitcode=1, signal=None),
              on("host-b", 5.03, "worker_failure", round=0, rank=1, local_rank=0, exitcode=1, signal=None),
              on("host-b", 5.04, "round_start", after=0), on("host-a", 5.05, "round_start", after=0)]
    events += three_in_round_one()
    gp = compute(events, {})
    assert [(f.kind, f.label, f.detected) for f in gp.faults] == [("join", "1 node(s) joined", T + 5.0)]


def test_a_join_that_waited_for_its_nodes_imports_counts_the_wait_as_start_up_not_idle() -> None:
    """Node c starts at 2.9 and defers its join (3.0 to 4.6) while its template imports; the running
    group notices it at 5.0.  Its slot: start-up until it joined, idle only until it was noticed."""
    events = [*two_nodes(),
              on("host-c", 2.9, "agent_start", run_id="job", nproc=1, pid=3, hostname="host-c"),
              on("host-c", 3.0, "round_start"), on("host-c", 3.0, "join_deferred"),
              on("host-c", 4.6, "join_resumed", waited=1.6, ended_by="ready"),
              on("host-a", 5.0, "nodes_waiting", round=0, count=1),
              on("host-a", 5.0, "restart", round=0, reason="1 node(s) waiting to join"),
              on("host-b", 5.0, "restart", round=0, reason="1 node(s) waiting to join"),
              on("host-b", 5.04, "round_start", after=0), on("host-a", 5.05, "round_start", after=0)]
    events += three_in_round_one()
    gp = compute(events, {})
    mine: dict[str, float] = {}
    for span in gp.spans:
        if span.node == "host-c" and span.end <= T + 5.3:
            mine[span.cause] = mine.get(span.cause, 0.0) + span.end - span.start
    assert mine == {"startup": pytest.approx(1.7), "idle": pytest.approx(0.4), "rendezvous": pytest.approx(0.3)}


def a_node_joins_and_is_preempted(node: str, agent_pid: int, at: float, rnd: int) -> tuple[list[dict], dict]:
    """``node`` starts at ``at``, joins nodes a and b in round ``rnd`` (from ``at`` + 0.7), steps until
    ``at`` + 2.98 and is pre-empted at ``at`` + 3.0 (SIGTERM: its worker exits 0, its agent 143); a and b
    re-form without it in round ``rnd`` + 1 (from ``at`` + 3.4).  Its events and everyone's records."""
    members = ["host-a", "host-b", node]
    events = [on(node, at, "agent_start", run_id="job", nproc=1, pid=agent_pid, hostname=node),
              on(node, at + 0.1, "round_start"),
              on(node, at + 3.0, "signal", signal="SIGTERM", action="forward", grace=20.0),
              on(node, at + 3.05, "worker_exit", pid=agent_pid * 100, local_rank=0, exitcode=0, signal=None),
              on(node, at + 3.1, "agent_exit", exitcode=143, reason="stopped by SIGTERM")]
    for survivor in ("host-a", "host-b"):
        events += [on(survivor, at + 0.5, "nodes_waiting", round=rnd - 1, count=1),
                   on(survivor, at + 0.5, "restart", round=rnd - 1, reason="1 node(s) waiting to join"),
                   on(survivor, at + 0.55, "round_start", after=rnd - 1),
                   on(survivor, at + 3.2, "node_lost", round=rnd + 1, lost=[node], causes={node: "left"}),
                   on(survivor, at + 3.2, "restart", round=rnd, reason=f"node(s) lost: {node}"),
                   on(survivor, at + 3.25, "round_start", after=rnd)]
    for r, world, names in ((rnd, 3, members), (rnd + 1, 2, members[:2])):
        for rank, name in enumerate(names):
            began = at + (0.7 if r == rnd else 3.4)
            events += [on(name, began, "round_closed", round=r, generation=r, world_size=world, members=names),
                       on(name, began, "worker_start", round=r, generation=r, rank=rank, local_rank=0,
                          pid=(agent_pid if name == node else rank + 1) * 100 + r, start_method="fork")]
    first = 10 * rnd  # the job's step count goes on from group to group
    steps = [restore(first, at + 0.7, at + 0.8, "live"),
             *(step(first + n, at + 0.3 + 0.5 * n, at + 0.7 + 0.5 * n, at + 0.8 + 0.5 * n) for n in range(1, 5))]
    last = step(first + 5, at + 2.8, at + 2.95, at + 3.03)  # its commit saw the SIGTERM and wrote a checkpoint
    logs = {(name, (agent_pid if name == node else rank + 1) * 100 + rnd):
            ProcessLog(0, name, T + at, [*steps, last]) for rank, name in enumerate(members)}
    return events, logs


def test_each_preempted_node_is_a_fault_of_its_own_and_its_training_is_kept() -> None:
    """Nodes c and d join nodes a and b in turn and are each pre-empted 3 s later (SIGTERM).  Two
    pre-emptions, two faults, each named after its node and its signal; each pre-empted node's steps
    are goodput up to the signal, and its slot's restart is the 0.1 s from the signal to its agent's
    exit, not also the moment its worker took to exit after that (once, every pre-emption of a job was
    one fault, timed at the first: the later nodes' whole training counted as its restart)."""
    events = two_nodes()
    logs = {(node, pid): ProcessLog(pid, node, T + 1, []) for node, pid in (("host-a", 100), ("host-b", 200))}
    for node, pid, at, rnd in (("host-c", 3, 1.5, 1), ("host-d", 4, 6.0, 3)):
        more, more_logs = a_node_joins_and_is_preempted(node, pid, at, rnd)
        events += more
        logs.update(more_logs)
    for rank, node in enumerate(("host-a", "host-b")):
        events += [on(node, 11.0, "worker_exit", pid=(rank + 1) * 100 + 4, local_rank=0, exitcode=0, signal=None),
                   on(node, 11.5, "agent_exit", exitcode=0)]
    gp = compute(events, logs)
    assert [f.label for f in gp.faults] == ["1 node(s) joined", "node host-c (pid 3) left (SIGTERM received)",
                                            "1 node(s) joined", "node host-d (pid 4) left (SIGTERM received)"]
    for node in ("host-c", "host-d"):
        mine: dict[str, float] = {}
        for span in gp.spans:
            if span.node == node:
                mine[span.cause] = mine.get(span.cause, 0.0) + span.end - span.start - span.inner
        assert mine["good"] == pytest.approx(4 * 0.4 + 0.15), (node, mine)
        assert mine["restart"] == pytest.approx(0.1), (node, mine)
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)


def test_a_fault_is_named_after_its_culprit_not_the_peer_whose_connection_it_closed() -> None:
    """Rank 1 (host-b) is SIGKILLed at 5.0; host-a's agent finds its own worker dead of the closed
    connection first (5.01, ``peer_error``), host-b's agent its killed worker later (5.05)."""
    events = [*two_nodes(),
              on("host-a", 5.01, "worker_exit", round=0, pid=100, local_rank=0, exitcode=1, signal=None),
              on("host-a", 5.01, "worker_failure", round=0, rank=0, local_rank=0, exitcode=1, signal=None,
                 peer_error=True),
              on("host-b", 5.05, "worker_exit", round=0, pid=200, local_rank=0, exitcode=None, signal="SIGKILL"),
              on("host-b", 5.05, "worker_failure", round=0, rank=1, local_rank=0, exitcode=None, signal="SIGKILL",
                 peer_error=False),
              on("host-a", 5.1, "round_start", after=0), on("host-b", 5.1, "round_start", after=0)]
    events += round_one(5.3)
    (fault,) = compute(events, {}).faults
    assert (fault.kind, fault.label, fault.node, fault.rank) == ("worker_failure", "rank 1 killed by SIGKILL",
                                                                 "host-b", 1)


def test_a_fault_known_only_from_the_peer_it_cut_off_starts_at_that_peers_last_step() -> None:
    """Rank 1 (host-b) is SIGKILLed at 5.02, after its step ended at 5.0; host-a's worker, waiting on it
    in a collective, fails of the closed connection and its agent reports that (``peer_error``, alive
    until 5.6), and host-b's agent stops its group for the new round before it sees its own worker's
    death: no failure names the culprit.  The fault is placed at the survivor's last finished step
    (5.0), not at its own late end: the 0.6 s in between are the fault's detection."""
    events = [*cut_off_by_a_peer(), *round_one(5.9)]
    logs = {("host-a", 100): ProcessLog(100, "host-a", T + 1.0, STEPS_TO_5)}
    (fault,) = compute(events, logs).faults
    assert fault.kind == "worker_failure" and fault.at == pytest.approx(T + 5.0, abs=0.01), (fault, T)
    assert fault.detected == pytest.approx(T + 5.65, abs=0.01)


def test_a_killed_worker_found_dead_as_its_group_ended_is_named_as_the_fault() -> None:
    """As above, but host-b's agent records its killed worker's exit as it ends its group for the new
    round (alive when last seen at 5.01): that death, not the peer it cut off, is the fault."""
    killed = on("host-b", 5.7, "worker_exit", round=0, pid=200, local_rank=0, rank=1, exitcode=None,
                signal="SIGKILL", alive_at=T + 5.01)
    events = [*cut_off_by_a_peer(killed), *round_one(5.9)]
    logs = {("host-a", 100): ProcessLog(100, "host-a", T + 1.0, STEPS_TO_5),
            ("host-b", 200): ProcessLog(200, "host-b", T + 1.0, STEPS_TO_5)}
    (fault,) = compute(events, logs).faults
    assert (fault.kind, fault.label, fault.node, fault.rank) == ("worker_failure", "rank 1 killed by SIGKILL",
                                                                 "host-b", 1)
    assert fault.at == pytest.approx(T + 5.01, abs=0.005)


def test_a_whole_job_preempted_at_once_is_one_fault() -> None:
    """Both nodes get SIGTERM at 5.2 s, inside step 8 (a SLURM pre-emption of the whole job): each worker
    ends that step with a checkpoint (5.5 s) and exits 0, each agent exits 143 at 5.6 s.  No node is left
    to re-form, so no round follows: the two ends are one fault, of the signal, and each slot's time from
    the signal to its agent's exit (0.4 s) is that fault's."""
    events = two_nodes()
    logs = {}
    for node, pid in (("host-a", 100), ("host-b", 200)):
        events += [on(node, 5.2, "signal", signal="SIGTERM", action="forward", grace=20.0),
                   on(node, 5.55, "worker_exit", pid=pid, local_rank=0, exitcode=0, signal=None),
                   on(node, 5.6, "agent_exit", exitcode=143, reason="stopped by SIGTERM")]
        logs[(node, pid)] = ProcessLog(pid, node, T + 1, [*STEPS_TO_5, step(8, 5.0, 5.4, 5.5)])
    gp = compute(events, logs)
    assert [(f.kind, f.label) for f in gp.faults] == [("signal", "SIGTERM received")]
    assert gp.badput["restart"] == pytest.approx(2 * 0.4)
    assert gp.good + sum(gp.badput.values()) == pytest.approx(gp.device_seconds)
