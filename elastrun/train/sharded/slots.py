"""Each rank's shard snapshots in its node's memory: one data file and one meta file per slot.

Layout in the node's snapshot directory (``/dev/shm``, owned by the agent), beside the replicated
state's ``shared.<slot>.*`` files of data-parallel jobs:

* ``shard.r<rank>.<slot>.data``: the raw bytes of every tensor chunk rank ``rank`` holds (64-byte
  aligned, the layout of :func:`elastrun.train.sharded.layout.lay_out`);
* ``shard.r<rank>.<slot>.meta``: the commit record (magic, CRC32 of its body, pickled header):
  job id, step, world size, rank, size of the data, the entries (key, dtype, global size, chunk
  offsets and shape, byte offset) and the skeleton of the non-tensor state.

The pair is self-describing: a byte-for-byte copy of both files into another node's snapshot
directory is a valid replica there (what peer replication needs).  The union of the meta files of
ranks ``0..world_size-1`` at one step is a DCP checkpoint's metadata
(:func:`elastrun.train.sharded.reader.dcp_metadata`).

Slots are written as for the replicated state (``elastrun/train/snapshot.py``): the oldest unpinned
slot is claimed, its meta unlinked before its data is overwritten, the meta renamed into place
after the copy.  A meta whose CRC does not match, a data file shorter than the meta says, or a
meta of another job is ignored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
        super().__init__(directory, run_id)

    def _data_path(self, slot: int) -> Path:
        return self.dir / f"{self._prefix}.{slot}.data"

    def _meta_path(self, slot: int) -> Path:
        return self.dir / f"{self._prefix}.{slot}.meta"

    def begin(self, nbytes: int) -> tuple[int, torch.Tensor, memoryview]:
        # A slot file pruned by another process (a stale world's file of the same name) is mapped
        # again: writing into an unlinked file would publish a snapshot nobody can read.
        for slot, m in list(self._maps.items()):
            if os.fstat(m.fd).st_nlink == 0:
                m.close()
                del self._maps[slot]
        return super().begin(nbytes)


@dataclass(frozen=True)
class ShardFile:
    """A complete snapshot of one rank's shard found in a node's directory."""

    rank: int
    slot: int
    step: int
    world_size: int
    header: dict[str, Any]
    data: Path


def scan(directory: Path, run_id: str, kind: str = "shard") -> list[ShardFile]:
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
            found.append(ShardFile(rank, info.slot, info.step, info.world_size, info.header, data))
    return found


def prune(directory: Path, run_id: str, world_size: int, below_step: int, kind: str = "shard") -> None:
    """Remove snapshots of other world sizes older than ``below_step`` (never needed again once
    every rank of this world committed a newer step), the meta first."""
    for f in scan(directory, run_id, kind):
        if f.world_size != world_size and f.step < below_step:
            for path in (f.data.with_suffix(".meta"), f.data):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass


def drop_newer(directory: Path, run_id: str, step: int, kind: str = "shard") -> None:
    """Unpublish every shard snapshot of this node newer than ``step``: after a restore to
    ``step`` they belong to an abandoned timeline and must never be mixed with new ones."""
    for f in scan(directory, run_id, kind):
        if f.step > step:
            try:
                f.data.with_suffix(".meta").unlink()
            except FileNotFoundError:
                pass
