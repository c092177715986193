"""Replica files, push requests and their checks: what a worker and its agent agree on about copies.

A worker's committed shard is the pair ``<name>.data`` / ``<name>.meta`` in its node's snapshot
directory (``elastrun/train/sharded/slots.py``).  Its copy on another node lies in that node's
``replicas/<source node>/`` directory under a slot name of the receiving agent's choosing:

* ``<name>.data``: the same bytes;
* ``<name>.meta``: the same meta file, byte for byte (its own CRC, the job id, step, world size...);
* ``<name>.sum``: :class:`Sums`, JSON written by the receiving agent: step, world size, size, the
  meta's CRC, and a CRC32 of every :data:`BLOCK` bytes of the data, computed by the *sending* agent
  from the original as it sent it and checked by the receiver before it published the replica.

Published in that order, the meta last (renamed into place): a replica without its meta is not
there.  Every read of a replica checks the CRCs of the blocks it touches (:func:`verify`), whether
the reader is a worker on that node or the node's snapshot server on behalf of another node: a
replica that is corrupt is never used, one that is truncated is not even listed (its data file is
shorter than its meta says).

A worker asks its agent to copy a committed shard with a push request, ``push.<kind>.r<rank>.json``
(:class:`PushRequest`), in its snapshot directory; the agent removes it once done and leaves the
outcome in ``replicated.<kind>.r<rank>.json`` (:class:`PushStatus`).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: The first bytes of every snapshot meta file (``elastrun/train/snapshot.py`` writes them).
META_MAGIC = b"ELSNAP01"
#: Bytes per CRC of a replica's data.
BLOCK = 8 << 20
REPLICAS = "replicas"


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Replace ``path`` with ``obj`` as JSON at once: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class CorruptReplica(ValueError):
    """A replica's data does not match the CRCs it was published with."""


def meta_crc(raw: bytes) -> int | None:
    """The CRC a meta file records of its own body, if the file is whole (None: torn or not a meta)."""
    if len(raw) < 12 or raw[:8] != META_MAGIC:
        return None
    (crc,) = struct.unpack("<I", raw[8:12])
    return crc if zlib.crc32(raw[12:]) == crc else None


def read_meta_crc(path: Path) -> int | None:
    """The recorded CRC of the meta file at ``path`` (its generation), or None."""
    try:
        with open(path, "rb") as f:
            raw = f.read(12)
    except (FileNotFoundError, IsADirectoryError):
        return None
    if len(raw) < 12 or raw[:8] != META_MAGIC:
        return None
    return struct.unpack("<I", raw[8:12])[0]


def block_crcs(view: memoryview, block: int = BLOCK) -> list[int]:
    return [zlib.crc32(view[i : i + block]) for i in range(0, len(view), block)]


@dataclass
class Sums:
    """A replica's ``.sum`` file."""

    step: int
    world_size: int
    nbytes: int
    meta_crc: int
    block: int
    crcs: list[int]

    def write(self, path: Path) -> None:
        _write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> Sums | None:
        try:
            obj = json.loads(path.read_text())
            sums = cls(**obj)
        except (OSError, ValueError, TypeError):
            return None
        expected = -(-sums.nbytes // sums.block) if sums.block > 0 else -1
        return sums if len(sums.crcs) == expected else None


def verify(data: memoryview, sums: Sums, start: int, end: int, what: str) -> None:
    """Check the CRCs of the blocks of ``data`` (a whole replica's bytes) that ``[start, end)`` touches."""
    if end <= start:
        return
    first, last = start // sums.block, (end - 1) // sums.block
    for b in range(first, last + 1):
        lo, hi = b * sums.block, min((b + 1) * sums.block, sums.nbytes)
        if zlib.crc32(data[lo:hi]) != sums.crcs[b]:
            raise CorruptReplica(f"{what}: bytes {lo}..{hi} do not match their CRC (a corrupt replica)")


def replica_dirs(snapshot_dir: Path) -> list[Path]:
    """The node's replica directories, one per source node."""
    try:
        return sorted(p for p in (Path(snapshot_dir) / REPLICAS).iterdir() if p.is_dir())
    except FileNotFoundError:
        return []


# ------------------------------------------------------------------------------------- push requests
_PUSH = re.compile(r"push\.(shard|dcp)\.r(\d+)\.json")


def push_path(snapshot_dir: Path, kind: str, rank: int) -> Path:
    return Path(snapshot_dir) / f"push.{kind}.r{rank}.json"


def status_path(snapshot_dir: Path, kind: str, rank: int) -> Path:
    return Path(snapshot_dir) / f"replicated.{kind}.r{rank}.json"


@dataclass
class PushRequest:
    """A worker asks its agent to copy one committed shard file to ``targets`` (snapshot servers)."""

    kind: str
    rank: int
    name: str  # the slot: ``<name>.data`` / ``<name>.meta`` in the snapshot directory
    step: int
    world_size: int
    nbytes: int
    meta_crc: int
    targets: list[str] = field(default_factory=list)
    #: Seconds between the worker's recent commits (0: unknown): how long the copy may take at idle
    #: priority before the agent gives it a share of a busy core (``elastrun/agent/replicator.py``).
    interval: float = 0.0

    def write(self, snapshot_dir: Path) -> Path:
        path = push_path(snapshot_dir, self.kind, self.rank)
        _write_json(path, asdict(self))
        return path

    @classmethod
    def read(cls, path: Path) -> PushRequest | None:
        """The request at ``path``; None when it is gone or not one (it is then ignored)."""
        try:
            obj = json.loads(path.read_text())
            req = cls(**obj)
        except (OSError, ValueError, TypeError):
            return None
        ok = (isinstance(req.kind, str) and isinstance(req.name, str) and isinstance(req.targets, list)
              and all(isinstance(v, int) for v in (req.rank, req.step, req.world_size, req.nbytes, req.meta_crc))
              and isinstance(req.interval, (int, float)))
        return req if ok else None


def pending_pushes(snapshot_dir: Path) -> list[Path]:
    try:
        names = os.listdir(snapshot_dir)
    except FileNotFoundError:
        return []
    return sorted(Path(snapshot_dir) / n for n in names if _PUSH.fullmatch(n))


@dataclass
class PushStatus:
    """The outcome of the last push of one rank's shard, written by the agent."""

    step: int
    ok: bool
    targets: list[str]
    nbytes: int
    seconds: float
    error: str = ""
    late: bool = False  # taken over from idle priority (the host had no idle CPU time for it)

    def write(self, path: Path) -> None:
        _write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> PushStatus | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def describe(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))[:200]
