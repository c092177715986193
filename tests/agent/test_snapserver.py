"""The agent's snapshot server, its replicator and the workers' client, in-process over loopback:
ranges served from node memory, replicas pushed and checked, and clients without the token
refused (issue 24)."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import psutil
import pytest
import torch

from elastrun.agent.replicator import Replicator
from elastrun.agent.snapserver import SnapshotServer, snapshot_key
from elastrun.shared import snapshot_wire as wire
from elastrun.shared.replicas import BLOCK, REPLICAS, PushRequest, PushStatus, push_path, status_path
from elastrun.train.sharded import slots
from elastrun.train.sharded.layout import lay_out
from elastrun.train.snapclient import Get, SnapshotClient, writable
from tests.train.test_idle_helpers import lowered

pytestmark = pytest.mark.unit

KEY = snapshot_key(b"a-job-token-of-some-length", "job")


def publish(directory, rank: int, step: int, nbytes: int) -> tuple[slots.ShardSlots, int, int, torch.Tensor]:
    """A real shard slot of ``nbytes`` random bytes; returns (slots, slot, meta CRC, the bytes)."""
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    entries, _, size = lay_out({"model.w": data})
    mem = slots.ShardSlots(directory, "job", rank)
    slot, buf, view = mem.begin(size)
    buf[:nbytes].copy_(data)
    del buf
    view.release()
    header = {"step": step, "world_size": 2, "rank": rank, "nbytes": size,
              "entries": [dataclasses.astuple(e) for e in entries], "skeleton": b""}  # fmt: skip
    return mem, slot, mem.publish(slot, header), data


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(name: str, key: bytes | None = KEY, bind: str = "127.0.0.1") -> SnapshotServer:
        d = tmp_path / name
        d.mkdir()
        server = SnapshotServer(d, key, (bind, 0), "127.0.0.1")
        server.start()
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


def test_ranges_are_served_from_node_memory_into_their_destination(servers):
    a = servers("a")
    mem, slot, crc, data = publish(a.dir, 3, 7, 3 * BLOCK + 123)
    into = torch.zeros(data.numel(), dtype=torch.uint8)
    half = data.numel() // 2
    with SnapshotClient(a.address, KEY) as client:
        errors = client.get([Get("", mem.name(slot), crc, 0, half, writable(into[:half])),
                             Get("", mem.name(slot), crc, half, data.numel() - half, writable(into[half:]))])
        assert errors == [None, None]
        assert torch.equal(into, data)
        # a generation the plan did not see (the slot was rewritten since) is refused, not served
        [error] = client.get([Get("", mem.name(slot), crc ^ 1, 0, 8, writable(into[:8]))])
        assert "not here any more" in error
        [error] = client.get([Get("", mem.name(slot), crc, 0, 10 * BLOCK, writable(torch.empty(10 * BLOCK,
                                                                                              dtype=torch.uint8)))])
        assert "truncated" in error
    mem.close()


def test_a_replica_is_pushed_checked_and_served_and_a_corrupt_one_refused(servers, tmp_path):
    a, b = servers("a"), servers("b")
    mem, slot, crc, data = publish(a.dir, 1, 5, 2 * BLOCK + 77)
    nbytes = mem.scan()[0].header["nbytes"]
    PushRequest("shard", 1, mem.name(slot), 5, 2, nbytes, crc, [b.address]).write(a.dir)
    rep = Replicator(a.dir, KEY, "node-a", warn=pytest.fail)
    status = rep.push(push_path(a.dir, "shard", 1))
    rep.close()
    assert status is not None and status.ok, status
    assert not push_path(a.dir, "shard", 1).exists()
    assert PushStatus.read(status_path(a.dir, "shard", 1)) == status
    [replica] = slots.scan_node(b.dir, "job")
    assert (replica.rank, replica.step, replica.where, replica.meta_crc) == (1, 5, "replicas/node-a", crc)
    assert replica.data.read_bytes()[: data.numel()] == bytes(data.numpy())

    into = torch.zeros(nbytes, dtype=torch.uint8)
    with SnapshotClient(b.address, KEY) as client:
        assert client.get([Get(replica.where, replica.name, crc, 0, nbytes, writable(into))]) == [None]
        assert torch.equal(into[: data.numel()], data)
        with open(replica.data, "r+b") as f:  # a flipped byte in the second block
            f.seek(BLOCK + 5)
            byte = f.read(1)
            f.seek(BLOCK + 5)
            f.write(bytes([byte[0] ^ 0xFF]))
        [error] = client.get([Get(replica.where, replica.name, crc, BLOCK, 16, writable(into[:16]))])
        assert "corrupt replica" in error
        # the first block is intact: a range inside it is still served
        assert client.get([Get(replica.where, replica.name, crc, 0, 16, writable(into[:16]))]) == [None]
    os.truncate(replica.data, BLOCK)  # a truncated replica is not listed at all
    assert slots.scan_node(b.dir, "job") == []
    mem.close()


def test_the_two_newest_replicas_of_a_rank_are_kept(servers):
    a, b = servers("a"), servers("b")
    rep = Replicator(a.dir, KEY, "node-a", warn=pytest.fail)
    mem = None
    for step in (1, 2, 3):
        mem, slot, crc, _ = publish(a.dir, 0, step, 1000)
        PushRequest("shard", 0, mem.name(slot), step, 2, mem.scan()[0].header["nbytes"], crc, [b.address]).write(a.dir)
        assert rep.push(push_path(a.dir, "shard", 0)).ok
        mem.close()
    rep.close()
    assert sorted(f.step for f in slots.scan_node(b.dir, "job")) == [2, 3]


def _connections_to(address: str) -> int:
    port = wire.split_address(address)[1]
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def test_a_node_that_is_no_longer_a_target_loses_its_connection_and_an_emptied_source_its_directory(servers):
    """After a re-form the copies go elsewhere: the replicator closes its connection to a node that is no
    longer a target (a lost node's would otherwise stay open, half-closed, for the agent's whole life),
    and a receiver removes the directory of a source none of whose replicas it keeps any more."""
    a, x, b, c = servers("a"), servers("x"), servers("b"), servers("c")
    rep = Replicator(a.dir, KEY, "node-a", warn=pytest.fail)
    other = Replicator(x.dir, KEY, "node-x", warn=pytest.fail)
    mem, slot, crc, _ = publish(x.dir, 0, 1, 1000)
    PushRequest("shard", 0, mem.name(slot), 1, 2, mem.scan()[0].header["nbytes"], crc, [c.address]).write(x.dir)
    assert other.push(push_path(x.dir, "shard", 0)).ok
    mem.close()
    other.close()
    for step, target in ((2, b), (3, c), (4, c)):
        mem, slot, crc, _ = publish(a.dir, 0, step, 1000)
        PushRequest("shard", 0, mem.name(slot), step, 2, mem.scan()[0].header["nbytes"], crc,
                    [target.address]).write(a.dir)
        assert rep.push(push_path(a.dir, "shard", 0)).ok
        mem.close()
        if step == 2:
            assert _connections_to(b.address) == 1
    assert (_connections_to(b.address), _connections_to(c.address)) == (0, 1)
    rep.close()
    assert sorted(f.step for f in slots.scan_node(c.dir, "job")) == [3, 4]
    assert sorted(p.name for p in (c.dir / REPLICAS).iterdir()) == ["node-a"]


def test_clients_without_the_token_read_nothing(servers):
    a = servers("a", bind="")
    mem, slot, crc, _ = publish(a.dir, 0, 1, 4096)
    port = wire.split_address(a.address)[1]
    with pytest.raises(wire.PeerError, match="requires the job token"):
        SnapshotClient(a.address, None)
    with pytest.raises(wire.PeerError, match="could not prove the job token"):
        SnapshotClient(a.address, snapshot_key(b"another-token-of-some-length", "job"))
    for hostile in ({"op": "get", "where": "", "name": mem.name(slot), "part": "meta"},  # no handshake
                    {"hello": wire.PROTOCOL, "nonce": "n", "auth": True, "proof": "0" * 64}):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            wire.send_msg(s, hostile)
            reply = wire.recv_msg(s)
            assert "error" in reply or set(reply) == {"nonce", "proof"}, reply
            if "error" not in reply:  # a guessed proof: refused, and nothing else is answered
                wire.send_msg(s, {"proof": "0" * 64})
                assert "error" in wire.recv_msg(s)
            with pytest.raises((wire.PeerError, OSError)):
                wire.send_msg(s, {"op": "get", "where": "", "name": mem.name(slot), "part": "meta"})
                wire.recv_msg(s)
    # a path outside the snapshot directory cannot even be named
    with SnapshotClient(a.address, KEY) as client:
        with pytest.raises(wire.PeerError, match="no such snapshot file"):
            client.meta("replicas/../..", "shard.r0.0")
    mem.close()


def test_without_a_token_the_server_listens_on_its_own_address_only(servers):
    a = servers("a", key=None)
    port = wire.split_address(a.address)[1]
    with SnapshotClient(a.address, None):
        pass
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    with pytest.raises(wire.PeerError, match="runs without a job token"):
        SnapshotClient(a.address, KEY)


def test_fetch_spreads_ranges_over_parallel_connections(servers, monkeypatch):
    """A fetch cuts ranges into pieces over several connections; each get gets its own answer."""
    from elastrun.train import snapclient

    monkeypatch.setattr(snapclient, "PIECE", 1 << 20)
    a = servers("a")
    mem, slot, crc, data = publish(a.dir, 0, 1, 5 * (1 << 20) + 3)
    into = torch.zeros(data.numel(), dtype=torch.uint8)
    bad = torch.zeros(8, dtype=torch.uint8)
    gets = [Get("", mem.name(slot), crc, 0, data.numel(), writable(into)),
            Get("", mem.name(slot), crc ^ 1, 0, 8, writable(bad))]  # fmt: skip
    errors = snapclient.fetch(a.address, KEY, gets, streams=3)
    assert errors[0] is None and "not here any more" in errors[1]
    assert torch.equal(into, data)
    mem.close()


def wait_status(directory, rank: int, step: int, seconds: float) -> PushStatus | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = PushStatus.read(status_path(directory, "shard", rank))
        if status is not None and status.step == step:
            return status
        time.sleep(0.01)
    return None


def test_a_running_replicator_finds_requests_as_they_are_written_and_takes_over_a_late_copy(servers):
    """The agent's replicator threads: a request is picked up as it appears (inotify; no polling);
    a copy still unfinished one commit interval after it began is finished by the late thread even
    while the idle thread cannot advance it (here: it cannot get the turn, as when no core is idle)."""
    a, b = servers("a"), servers("b")
    rep = Replicator(a.dir, KEY, "node-a", warn=pytest.fail)
    rep.start()
    try:
        assert rep._watch is not None and rep._watch.active
        mem, slot, crc, data = publish(a.dir, 0, 1, 3 * BLOCK)
        nbytes = mem.scan()[0].header["nbytes"]
        PushRequest("shard", 0, mem.name(slot), 1, 2, nbytes, crc, [b.address], interval=60.0).write(a.dir)
        status = wait_status(a.dir, 0, 1, 30)
        assert status is not None and status.ok and not status.late, status  # in time: idle priority only

        mem2, slot2, crc2, data2 = publish(a.dir, 0, 2, 3 * BLOCK)
        with rep._turn:  # the idle thread cannot take a single piece
            PushRequest("shard", 0, mem2.name(slot2), 2, 2, nbytes, crc2, [b.address], interval=0.3).write(a.dir)
            deadline = time.monotonic() + 30
            while not rep.stats["late"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rep.stats["late"] == 1  # the dispatcher gave up on idle priority after the interval
        status = wait_status(a.dir, 0, 2, 30)
        assert status is not None and status.ok and status.late, status
        found = {f.step: f for f in slots.scan_node(b.dir, "job")}
        assert found[2].data.read_bytes()[: data2.numel()] == bytes(data2.numpy())
        mem.close()
        mem2.close()
    finally:
        rep.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_no_low_priority_thread_outlives_its_copy(servers):
    """A process ends only when each of its threads has run its exit: an idle-priority thread parked in
    the agent kept a SIGKILLed agent, and its sockets, alive for 10 s on a busy host.  So the dispatcher
    runs at normal priority and a copy's idle and late threads end with the copy."""
    a, b = servers("a"), servers("b")
    rep = Replicator(a.dir, KEY, "node-a", warn=pytest.fail)
    rep.start()
    try:
        mem, slot, crc, _ = publish(a.dir, 0, 1, 3 * BLOCK)
        nbytes = mem.scan()[0].header["nbytes"]
        with rep._turn:  # the idle thread waits for the turn: the copy is late, a late thread joins it
            PushRequest("shard", 0, mem.name(slot), 1, 2, nbytes, crc, [b.address], interval=0.2).write(a.dir)
            deadline = time.monotonic() + 30
            while len(rep._copiers) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            idle = next(t for t in rep._copiers if t.name == "elastrun-replicator-idle")
            while not lowered(idle.native_id) and time.monotonic() < deadline:
                time.sleep(0.01)  # it lowers its own priority first thing, once it runs
            assert lowered(idle.native_id)
        status = wait_status(a.dir, 0, 1, 30)
        assert status is not None and status.ok and status.late, status
        for t in rep._copiers:
            t.join(30)
        assert not [t.name for t in rep._copiers if t.is_alive()]
        dispatcher = rep._thread.native_id
        assert os.sched_getscheduler(dispatcher) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, dispatcher) == os.getpriority(os.PRIO_PROCESS, 0)
        mem.close()
    finally:
        rep.close()
