"""A c10d round with many nodes in one process (real handlers, a real TCPStore), with and without a
job token: every node gets a distinct group rank, contiguous global ranks, the same world and the
same workers' store; then one node leaves and every other member is told."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.c10d import closing, create_handler, seats
from elastrun.rendezvous.c10d.status import read_store_status
from tests import warm
from tests.harness import base_env, free_port

pytestmark = pytest.mark.contract

NODES = 24
#: For the tests of a round's layout, not of liveness: dozens of handlers share one process (and, in CI,
#: 2 cores with other tests), where a heartbeat thread can stand still past the default 2.5 s; a
#: round whose closer looks silent is rightly given up (test_silent_closer.py), and its number moves on.
CALM = {"heartbeat_timeout": "30"}


@pytest.mark.parametrize("seated", [False, True], ids=["full-list", "seated"])
@pytest.mark.parametrize("token", [False, True], ids=["plain", "token"])
def test_a_round_with_many_nodes_is_consistent(token, seated, monkeypatch):
    if seated:  # the layout of a round of more than 64 members (seats.py), at a size that fits a test
        monkeypatch.setattr(closing, "FULL_LIST_MAX", 8)
        monkeypatch.setattr(seats, "PART_ROWS", 5)
    if token:
        monkeypatch.setenv("ELASTRUN_JOB_TOKEN", "many-nodes-0123456789abcdef0123456789")
    else:
        monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)
    port = free_port()

    def params(i: int) -> RendezvousParameters:
        return RendezvousParameters("c10d", f"127.0.0.1:{port}", "many", NODES, NODES,
                                    config={"is_host": str(i == 0).lower(), "host_linger": "0", **CALM})

    handlers = [create_handler(params(0))]
    handlers += [create_handler(params(i)) for i in range(1, NODES)]
    results: dict[int, object] = {}
    try:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, handlers[i].next_round(NodeInfo(f"node{i:02d}", "127.0.0.1", 2, hostname=f"h{i}")))) for i in
            range(NODES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == NODES
        views = list(results.values())
        assert sorted(r.group_rank for r in views) == list(range(NODES))
        assert {(r.round, r.generation, r.group_world_size, r.world_size) for r in views} == {(0, 0, NODES, 2 * NODES)}
        assert sorted(r.rank_offset for r in views) == list(range(0, 2 * NODES, 2))
        assert len({(r.store_addr, r.store_port) for r in views}) == 1
        # A member of a seated round knows itself and its ring successor; of a small round, everyone.
        by_rank = {r.group_rank: r for r in views}
        for r in views:
            known = [m.group_rank for m in r.members]
            assert known == (sorted({r.group_rank, (r.group_rank + 1) % NODES}) if seated else list(range(NODES)))
        # The status reader lists every member, from the parts of a seated round.  A member's first
        # heartbeat is written by its heartbeat thread once its round closed: until every one is in,
        # the job reads as "degraded" (a loaded machine can take a moment), so wait for it (bounded).
        deadline = time.monotonic() + 15
        while True:
            status = read_store_status(handlers[0]._store, "many", auth=handlers[0]._auth)
            if status["state"] == "running" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [n["group_rank"] for n in status["nodes"]] == list(range(NODES))
        assert status["world_size"] == 2 * NODES and status["state"] == "running"
        # A node leaves: every other member's poll reports it (bounded wait).
        leaver = 5
        handlers[leaver].leave("test")
        # Its ring predecessor now watches the node after it (a seated ring walks on, seat by seat).
        rank = results[leaver].group_rank
        pred = next(i for i, r in results.items() if r.group_rank == (rank - 1) % NODES)
        after = by_rank[(rank + 1) % NODES]
        target = handlers[pred]._ring_target(handlers[pred]._round, handlers[pred]._roster, handlers[pred]._store)
        assert target is not None and target.group_rank == after.group_rank
        told: set[int] = set()
        deadline = time.monotonic() + 10
        while len(told) < NODES - 1 and time.monotonic() < deadline:
            told |= {i for i, h in enumerate(handlers) if i != leaver and i not in told
                     and h.poll().lost_nodes == [f"node{leaver:02d}"]}
            time.sleep(0.05)
        assert told == set(range(NODES)) - {leaver}
    finally:
        for h in reversed(handlers):
            h.close()


_FIRST_JOINER = """
import os, signal, sys, time
from elastrun.rendezvous.api import NodeInfo, RendezvousParameters
from elastrun.rendezvous.c10d import create_handler
conf = {"is_host": "false", "host_linger": "0", "heartbeat_interval": "0.2", "heartbeat_timeout": "1"}
h = create_handler(RendezvousParameters("c10d", sys.argv[1], sys.argv[2], int(sys.argv[4]), 3, config=conf))
if sys.argv[3] == "stuck":
    h._claim = lambda *args, **kwargs: time.sleep(3600)  # the fault: its close never happens, its heartbeats go on
if sys.argv[3] == "dies_closing":  # the fault: it dies after its close, before its result
    h._publish_result = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
h.next_round(NodeInfo("first", "127.0.0.1", 1, hostname="first", prev_group_rank=2))  # rank 0 hosts the workers' store
"""


def _round_after_a_faulty_first_joiner(monkeypatch, fault: str, min_nodes: int = 3) -> tuple[dict, float]:
    """A round of up to 3 nodes with a job token whose first joiner is a process of its own: once it
    joined, ``fault`` is applied ("killed": SIGKILL; "stuck": its close never happens, its heartbeats
    go on; "dies_closing": it dies once it closed the round, before the result), then the two other
    nodes join.  Returns their round results by name and how long they took."""
    run_id = f"first-{fault}"
    monkeypatch.setenv("ELASTRUN_JOB_TOKEN", f"{run_id}-0123456789abcdef0123456789")
    port = free_port()
    conf = {"host_linger": "0", "heartbeat_interval": "0.2", "heartbeat_timeout": "1", "join_timeout": "60"}

    def params(host: bool) -> RendezvousParameters:
        return RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, min_nodes, 3,
                                    config={**conf, "is_host": str(host).lower()})

    host = create_handler(params(True))
    other = create_handler(params(False))
    child = warm.popen([sys.executable, "-c", _FIRST_JOINER, f"127.0.0.1:{port}", run_id, fault,
                        str(min_nodes)],
                       env=base_env())
    results: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 30
        while host._read(host._r(0, "node", 1)) is None and time.monotonic() < deadline:
            assert child.poll() is None
            time.sleep(0.05)
        assert host._read(host._r(0, "node", 1)) is not None, "the first joiner did not join"
        if fault == "killed":
            child.kill()
            child.wait(10)
        threads = [threading.Thread(target=lambda h=h, n=n: results.__setitem__(
            n, h.next_round(NodeInfo(n, "127.0.0.1", 1, hostname=n)))) for h, n in ((host, "host"), (other, "other"))]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        took = time.monotonic() - started
        if fault == "stuck":
            assert child.poll() is None, "the stuck first joiner must still be alive (and heartbeating)"
        assert set(results) == {"host", "other"}
        return results, took
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        other.close()
        host.close()


@pytest.mark.e2e
def test_with_a_token_a_round_whose_first_joiner_died_is_closed_by_the_next_joiner(monkeypatch):
    """The first joiner closes a round; the others step in only once it stopped heartbeating (its
    process is gone here): the round closes with the joins there are, the dead one included (the
    ring watch finds it next)."""
    results, took = _round_after_a_faulty_first_joiner(monkeypatch, "killed")
    assert {r.group_world_size for r in results.values()} == {3}
    assert {m.node_id for m in results["host"].members} == {"first", "host", "other"}
    assert results["host"].members[2].node_id == "first"
    assert took < 15  # grace 2 s + heartbeat silence 1 s + the close


@pytest.mark.e2e
def test_with_a_token_a_first_joiner_that_heartbeats_but_never_closes_is_rescued(monkeypatch):
    """A first joiner whose close is stuck while its heartbeats go on: the next joiners leave it
    alone for their grace plus four heartbeat timeouts (it might only be slow), then close the round."""
    results, took = _round_after_a_faulty_first_joiner(monkeypatch, "stuck")
    assert {m.node_id for r in results.values() for m in r.members} == {"first", "host", "other"}
    # Not before grace (2 s) + 4 heartbeat timeouts (4 s): it was alive; well before join_timeout.
    assert 5.5 < took < 15, took


@pytest.mark.e2e
def test_a_round_whose_closer_died_before_its_result_is_given_up_and_the_next_one_forms(monkeypatch):
    """The first joiner closes round 0 and dies before it publishes the result.  The others stop
    waiting for that result once the closer's heartbeats stopped (not at ``join_timeout``), and the
    two survivors form round 1 (``min_nodes`` 2)."""
    results, took = _round_after_a_faulty_first_joiner(monkeypatch, "dies_closing", min_nodes=2)
    assert {r.round for r in results.values()} == {1}
    assert {r.group_world_size for r in results.values()} == {2}
    assert {m.node_id for m in results["host"].members} == {"host", "other"}
    assert took < 20, took  # grace 2-4 s + heartbeat silence 1 s, twice, + round 1's last call 1 s


def test_old_rounds_keys_are_deleted_so_the_store_stays_bounded(monkeypatch):
    """After each round the closer deletes the keys of the round KEEP_ROUNDS before it, seats and
    parts of a seated round included: a job that goes through many rounds keeps a bounded store."""
    monkeypatch.setattr(closing, "FULL_LIST_MAX", 3)
    monkeypatch.setattr(seats, "PART_ROWS", 2)
    monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)
    nodes, rounds = 5, closing.KEEP_ROUNDS + 3
    port = free_port()
    handlers = [create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", "prune", nodes, nodes,
                                                    config={"is_host": str(i == 0).lower(), "host_linger": "0",
                                                            **CALM}))
                for i in range(nodes)]
    try:
        for expected in range(rounds):
            results: dict[int, object] = {}
            threads = [threading.Thread(target=lambda i=i, out=results: out.__setitem__(
                i, handlers[i].next_round(NodeInfo(f"node{i}", "127.0.0.1", 1)))) for i in range(nodes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert {r.round for r in results.values()} == {expected}
        store, prefix = handlers[0]._store, handlers[0]._prefix
        gone_round = rounds - 1 - closing.KEEP_ROUNDS  # the newest round whose keys must be gone by now
        old_keys = [f"r{gone_round}/{k}" for k in ("result", "joined", "node/1", "part/0", "seat/node0")]
        kept_keys = [f"r{gone_round + 1}/{k}" for k in ("result", "part/0", "seat/node0")]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(store.check([prefix + k]) for k in old_keys):
            time.sleep(0.05)
        assert not [k for k in old_keys if store.check([prefix + k])], "an old round's keys were left"
        assert all(store.check([prefix + k]) for k in kept_keys), "a recent round's keys were deleted"
    finally:
        for h in reversed(handlers):
            h.close()


def test_a_fresh_joiner_heartbeats_only_once_its_round_closed(monkeypatch):
    """Slot 1 (the closer, whose beats its followers watch) heartbeats while it waits; the other fresh
    joiners write no ``hb/`` key until the round closes (at thousands of nodes their beats during
    the wait cost the store O(n²) per round), and every member heartbeats once it formed."""
    monkeypatch.delenv("ELASTRUN_JOB_TOKEN", raising=False)
    port = free_port()
    conf = {"host_linger": "0", "heartbeat_interval": "0.1", "heartbeat_timeout": "1", "join_timeout": "30"}

    def handler(i: int):
        return create_handler(RendezvousParameters("c10d", f"127.0.0.1:{port}", "beats", 3, 3,
                                                   config={**conf, "is_host": str(i == 0).lower()}))

    handlers = [handler(i) for i in range(3)]
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, handlers[i].next_round(NodeInfo(f"n{i}", "127.0.0.1", 1, hostname=f"h{i}")))) for i in range(3)]
    try:
        store = handlers[0]._store
        threads[0].start()
        threads[1].start()
        deadline = time.monotonic() + 10
        while int(store.add("/elastrun/beats/r0/joined", 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # five heartbeat intervals with two of the three joined
        first = handlers[0]._k("r0", "node", 1)
        slot1 = store.get(first).decode()
        beating = {n for n in ("n0", "n1") if store.check([handlers[0]._k("hb", n)])}
        assert beating == {"n0" if '"n0"' in slot1 else "n1"}, (slot1, beating)
        threads[2].start()
        for t in threads:
            t.join(20)
        assert len(results) == 3
        deadline = time.monotonic() + 5
        while not store.check([handlers[0]._k("hb", f"n{i}") for i in range(3)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.check([handlers[0]._k("hb", f"n{i}") for i in range(3)])
    finally:
        for t in threads:
            t.join(20)
        for h in reversed(handlers):
            h.close()
