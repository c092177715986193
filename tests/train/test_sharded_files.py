"""Sharded-state pieces in-process (no process group): shard slots, the restore plan, DCP metadata
from the snapshots, and the resharding reads DCP's planner asks for (issue 24)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from elastrun.shared.replicas import REPLICAS, CorruptReplica, Sums, block_crcs
from elastrun.train.sharded import slots
from elastrun.train.sharded.fetch import FileRef, LocalFile, PeerTransport, Resolver
from elastrun.train.sharded.layout import Ref, join, lay_out, split
from elastrun.train.sharded.reader import dcp_metadata, read_items
from elastrun.train.sharded.shard_plan import ShardReport, make_plan

pytestmark = pytest.mark.unit


def write_shard(directory, rank: int, step: int, world: int, rows: range, full: torch.Tensor) -> None:
    """Rank ``rank``'s shard file of ``step``: rows ``rows`` of ``full`` (a Shard(0) layout) and a scalar."""
    chunk = full[rows.start : rows.stop]
    tensors = {"model.w": chunk, "optimizer.state.w.step": torch.tensor(float(step))}
    entries, locals_, nbytes = lay_out(tensors)
    entries[0] = dataclasses.replace(entries[0], size=tuple(full.shape), offsets=(rows.start, 0))
    mem = slots.ShardSlots(directory, "job", rank)
    slot, buf, view = mem.begin(nbytes)
    for e, t in zip(entries, locals_, strict=True):
        buf[e.offset : e.offset + e.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    del buf
    view.release()
    header = {"step": step, "world_size": world, "rank": rank, "nbytes": nbytes,
              "entries": [dataclasses.astuple(e) for e in entries], "skeleton": b""}  # fmt: skip
    mem.publish(slot, header)
    mem.close()


def test_split_and_join_name_tensors_as_dcp_does():
    tree = {"model": {"0.weight": torch.ones(2)}, "optimizer": {"state": {"0.weight": {"exp_avg": torch.zeros(2)}},
            "param_groups": [{"lr": 0.1, "params": ["0.weight"]}]}, "elastrun": {"step": 3}}  # fmt: skip
    skeleton, tensors = split(tree)
    assert list(tensors) == ["model.0.weight", "optimizer.state.0.weight.exp_avg"]
    assert skeleton["model"]["0.weight"] == Ref("model.0.weight") and skeleton["elastrun"] == {"step": 3}
    assert torch.equal(join(skeleton, tensors)["optimizer"]["state"]["0.weight"]["exp_avg"], torch.zeros(2))


def test_truncated_or_corrupt_shard_snapshots_are_ignored(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    for step in (1, 2):
        write_shard(tmp_path, 0, step, 2, range(0, 3), full)
        write_shard(tmp_path, 1, step, 2, range(3, 6), full)
    assert sorted((f.rank, f.step) for f in slots.scan(tmp_path, "job")) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    newest = {(f.rank, f.step): f for f in slots.scan(tmp_path, "job")}
    with open(newest[(1, 2)].data, "r+b") as f:  # truncated data: the meta says more
        f.truncate(newest[(1, 2)].header["nbytes"] - 1)
    meta = newest[(0, 1)].data.with_suffix(".meta")
    raw = bytearray(meta.read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in the meta: its CRC does not match
    meta.write_bytes(bytes(raw))
    assert sorted((f.rank, f.step) for f in slots.scan(tmp_path, "job")) == [(0, 2), (1, 1)]
    assert slots.scan(tmp_path, "another-job") == []


def test_plan_prefers_complete_memory_then_disk():
    def report(rank, node, shards, disk=None):
        rng = {r: [s for (s, _), olds in shards.items() for o in olds if o == r] for r in range(3)}
        return ShardReport(rank, node, shards, rng, disk or {}, {s: [0, 1] for s in (disk or {})})

    # two old ranks on two nodes; a third node joins with nothing
    a = report(0, "A", {(9, 2): [0], (10, 2): [0]})
    b = report(1, "B", {(9, 2): [1]})  # B's step 10 never completed
    c = report(2, "C", {})
    plan = make_plan([a, b, c])
    assert (plan.step, plan.source, plan.holders) == (9, "memory", {0: [0], 1: [1]})
    # node B lost: its shard is nowhere, the disk checkpoint is used
    plan = make_plan([report(0, "A", {(9, 2): [0], (10, 2): [0]}, disk={8: 2})])
    assert (plan.step, plan.source) == (8, "disk")
    # a file that failed to load is excluded and the plan falls back
    assert make_plan([a, b, c], {("mem", "B", 9, 1)}) is None
    assert make_plan([c]) is None


class _NoPeers(PeerTransport):
    def fetch(self, wants, serve):
        assert not wants, "everything is in this node's memory"


def test_reads_are_planned_by_dcp_over_the_mapped_files(tmp_path):
    """Old world 2 (rows 0-2 and 3-5), one new rank holding the whole tensor: DCP's planner asks
    for both old chunks and they are copied straight from the node's mapped files (the per-rank
    slicing at other world sizes is DTensor's: the launcher tests cover it)."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    write_shard(tmp_path, 0, 5, 2, range(0, 3), full)
    write_shard(tmp_path, 1, 5, 2, range(3, 6), full)
    found = {f.rank: f for f in slots.scan(tmp_path, "job")}
    headers = {r: f.header for r, f in found.items()}
    local = {FileRef(r, 5): LocalFile(f.data, f.header["nbytes"]) for r, f in found.items()}
    metadata, where = dcp_metadata(headers, lambda key, ranks: min(ranks))
    dest = {"model.w": torch.full((6, 4), -1.0), "optimizer.state.w.step": torch.tensor(0.0)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, metadata, True)
    plan = planner.create_local_plan()
    assert len(plan.items) == 3  # two chunks of w, one scalar
    failed: set = set()
    assert read_items(plan, planner, where, Resolver(local, {}, 0), _NoPeers(), failed) == set()
    assert torch.equal(dest["model.w"], full) and float(dest["optimizer.state.w.step"]) == 5.0
    assert not failed


def test_metadata_of_incomplete_chunks_is_refused(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    write_shard(tmp_path, 0, 5, 2, range(0, 3), full)
    headers = {0: slots.scan(tmp_path, "job")[0].header}
    with pytest.raises(ValueError, match="cover 12 of its 24 elements"):
        dcp_metadata(headers, lambda key, ranks: min(ranks))


def test_a_corrupt_or_truncated_replica_is_not_used(tmp_path):
    """A replica (another node's shard file copied here by the agents, with block CRCs) is read only
    where its blocks match their CRCs: a flipped byte fails the read, the copy is excluded and the
    plan goes back to what is whole; a truncated replica is not even listed."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    write_shard(tmp_path, 0, 5, 2, range(0, 3), full)  # this node's own rank 0
    replica_dir = tmp_path / REPLICAS / "node-b"
    replica_dir.mkdir(parents=True)
    write_shard(replica_dir, 1, 5, 2, range(3, 6), full)  # rank 1's file, copied from node B
    [theirs] = slots.scan(replica_dir, "job")
    nbytes = theirs.header["nbytes"]
    Sums(5, 2, nbytes, theirs.meta_crc, 16, block_crcs(memoryview(theirs.data.read_bytes()[:nbytes]), 16)).write(
        theirs.data.with_suffix(".sum"))  # fmt: skip
    found = {f.rank: f for f in slots.scan_node(tmp_path, "job")}
    assert found[1].where == "replicas/node-b" and found[1].sums is not None
    report = ShardReport(0, "A", {(5, 2): sorted(found)}, {0: [5], 1: [5]}, {3: 2}, {3: [0, 1]})
    assert make_plan([report]).source == "memory"

    with open(theirs.data, "r+b") as f:  # one flipped byte in the replica's first block
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    local = {FileRef(r, 5): LocalFile(f.data, f.header["nbytes"], f.sums) for r, f in found.items()}
    metadata, where = dcp_metadata({r: f.header for r, f in found.items()}, lambda key, ranks: min(ranks))
    dest = {"model.w": torch.full((6, 4), -1.0), "optimizer.state.w.step": torch.tensor(0.0)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, metadata, True)
    failed: set = set()
    with pytest.raises(CorruptReplica, match="do not match their CRC"):
        read_items(planner.create_local_plan(), planner, where, Resolver(local, {}, 0), _NoPeers(), failed)
    assert failed == {(0, FileRef(1, 5))}
    plan = make_plan([report], {("mem", "A", 5, 1)})  # that copy excluded: back to the checkpoint
    assert (plan.step, plan.source, plan.lost) == (3, "disk", (5, [1]))

    os.truncate(theirs.data, nbytes - 1)  # a truncated replica is not listed
    assert sorted(f.rank for f in slots.scan_node(tmp_path, "job")) == [0]
