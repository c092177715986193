"""Each rank's shard snapshots in its node's memory: one data file and one meta file per slot.

Layout in the node's snapshot directory (``/dev/shm``, owned by the agent), beside the replicated
state's ``shared.<slot>.*`` files of data-parallel jobs:

* ``shard.r<rank>.<slot>.data``: the raw bytes of every tensor chunk rank ``rank`` holds (64-byte
  aligned, the layout of :func:`elastrun.train.sharded.layout.lay_out`);
* ``shard.r<rank>.<slot>.meta``: the commit record (magic, CRC32 of its body, pickled header):
  job id, step, world size, rank, size of the data, the entries (key, dtype, global size, chunk
  offsets and shape, byte offset) and the skeleton of the non-tensor state.

The pair is self-describing: a byte-for-byte copy of both files is a valid replica on another
node.  The agents make such copies (``replicas/<source node>/``, with a ``.sum`` file of block CRCs:
``elastrun/shared/replicas.py``); :func:`scan_node` lists a node's own files and its replicas.  The
union of the meta files of ranks ``0..world_size-1`` at one step is a DCP checkpoint's metadata
(:func:`elastrun.train.sharded.reader.dcp_metadata`).

Slots are written as for the replicated state (``elastrun/train/snapshot.py``): the oldest unpinned
slot is claimed, its meta unlinked before its data is overwritten, the meta renamed into place
after the copy.  A slot being copied to other nodes is *held*: it is overwritten only when no
other slot is free.  A meta whose CRC does not match, a data file shorter than the meta says, a
meta of another job, or a replica without valid CRCs is ignored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastrun.shared.replicas import REPLICAS, Sums, replica_dirs
from elastrun.train.snapshot import MemorySnapshots

#: ``State``'s snapshots; :mod:`elastrun.train.sharded.storage` writes kind ``dcp`` for ``dcp.save``.
KINDS = ("shard", "dcp")


def prefix(rank: int, kind: str = "shard") -> str:
    return f"{kind}.r{rank}"


class ShardSlots(MemorySnapshots):
    """The slots of one rank's shard in a node's snapshot directory (writer and reader)."""

    def __init__(self, directory: Path, run_id: str, rank: int, kind: str = "shard") -> None:
        self.rank = rank
        self.kind = kind
        self._prefix = prefix(rank, kind)
        self._held: set[int] = set()
        super().__init__(directory, run_id)

    def name(self, slot: int) -> str:
        """The slot's name (``<name>.data``, ``<name>.meta``), by which snapshot servers serve it."""
        return f"{self._prefix}.{slot}"

    def hold(self, slot: int) -> None:
        """Keep ``slot`` while it is being (or was last) copied to other nodes, if another is free."""
        with self._lock:
            self._held.add(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            self._held.discard(slot)

    def _choose(self, free: list[int]) -> int:
        return super()._choose([s for s in free if s not in self._held] or free)

    def _data_path(self, slot: int) -> Path:
        return self.dir / f"{self._prefix}.{slot}.data"

    def _meta_path(self, slot: int) -> Path:
        return self.dir / f"{self._prefix}.{slot}.meta"

    def begin(self, nbytes: int, ready_only: bool = False) -> tuple[int, torch.Tensor, memoryview] | None:
        # A slot file pruned by another process (a stale world's file of the same name) is mapped
        # again: writing into an unlinked file would publish a snapshot nobody can read.
        with self._lock:
            for slot, m in list(self._maps.items()):
                if slot not in self._preparing and os.fstat(m.fd).st_nlink == 0:
                    m.close()
                    del self._maps[slot]
                    if self._prepared_for:
                        self._prepared_for = 0  # made ready again at the next prepare()
        return super().begin(nbytes, ready_only)


@dataclass(frozen=True)
class ShardFile:
    """A complete snapshot of one rank's shard found in a node's directory."""

    rank: int
    slot: int
    step: int
    world_size: int
    header: dict[str, Any]
    data: Path
    meta_crc: int = 0
    where: str = ""  # "" (written on this node) or "replicas/<source node>"
    sums: Sums | None = None  # a replica's block CRCs

    @property
    def name(self) -> str:
        return self.data.name.removesuffix(".data")


def scan(directory: Path, run_id: str, kind: str = "shard", where: str = "") -> list[ShardFile]:
    """Every complete shard snapshot of ``kind`` in ``directory`` (any rank, any step)."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    pattern = re.compile(rf"^{re.escape(kind)}\.r(\d+)\.(\d+)\.meta$")
    ranks = sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})
    for rank in ranks:
        reader = ShardSlots(directory, run_id, rank, kind)
        for info in reader.scan():
            data = reader._data_path(info.slot)
            sums = None
            if where:  # a replica counts only with CRCs of the same generation covering all of it
                sums = Sums.read(data.with_suffix(".sum"))
                if sums is None or sums.meta_crc != info.meta_crc or sums.nbytes != info.header["nbytes"]:
                    continue
            found.append(ShardFile(rank, info.slot, info.step, info.world_size, info.header, data, info.meta_crc,
                                   where, sums))  # fmt: skip
        reader.close()
    return found


def scan_node(snapshot_dir: Path, run_id: str, kind: str = "shard") -> list[ShardFile]:
    """The node's own shard snapshots and the replicas it holds for other nodes; a file it has both
    ways (same rank, step and world size) is listed once, its own copy."""
    found = {(f.rank, f.step, f.world_size): f for f in scan(snapshot_dir, run_id, kind)}
    for d in replica_dirs(snapshot_dir):
        for f in scan(d, run_id, kind, f"{REPLICAS}/{d.name}"):
            found.setdefault((f.rank, f.step, f.world_size), f)
    return list(found.values())


def _directories(snapshot_dir: Path) -> list[Path]:
    return [Path(snapshot_dir), *replica_dirs(snapshot_dir)]


def prune(directory: Path, run_id: str, world_size: int, below_step: int, kind: str = "shard") -> None:
    """Remove snapshots and replicas of other world sizes older than ``below_step`` (never needed
    again once every rank of this world committed a newer step), the meta first."""
    for d in _directories(directory):
        for f in scan(d, run_id, kind):
            if f.world_size != world_size and f.step < below_step:
                for path in (f.data.with_suffix(".meta"), f.data.with_suffix(".sum"), f.data):
                    path.unlink(missing_ok=True)


def drop_newer(directory: Path, run_id: str, step: int, kind: str = "shard") -> None:
    """Unpublish every shard snapshot and replica of this node newer than ``step``: after a restore
    to ``step`` they belong to an abandoned timeline and must never be mixed with new ones."""
    for d in _directories(directory):
        for f in scan(d, run_id, kind):
            if f.step > step:
                f.data.with_suffix(".meta").unlink(missing_ok=True)
