"""Node-local memory snapshots that outlive the worker process.

Layout of the snapshot directory (on ``/dev/shm``, owned by the node's agent):

* ``shared.<slot>.data`` / ``shared.<slot>.meta``: the replicated state (model, optimizer, sampler,
  extras), written by local rank 0 only.  ``SLOTS`` slots are reused round-robin (oldest step
  first) so the data files stay mapped and their pages stay allocated: a snapshot is one memory copy.
* ``rng.r<rank>.s<step>``: each rank's RNG states, written by that rank at every commit.

A slot is whole or ignored: its ``.meta`` is unlinked before the data is overwritten and renamed
into place (with a CRC of its own bytes) only after the copy has finished.  A worker SIGKILLed in
the middle of a copy therefore leaves that slot without a meta, and the other slots untouched.
The data itself carries no checksum: the meta is the commit record, and checksumming a gigabyte
per step would cost more than the copy.  Four slots: under DDP the ranks' snapshot progress can
differ by one step (a rank may be copying step s+1 while another is still on step s), so the two
newest complete steps must survive, plus one being written, plus one being persisted to disk.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastrun.peer.replicas import META_MAGIC, meta_crc
from elastrun.train.fileio import atomic_write

SLOTS = 4
RNG_KEEP = 8


@dataclass
class SlotInfo:
    """A complete snapshot found in a slot."""

    slot: int
    step: int
    world_size: int
    header: dict[str, Any]
    meta_crc: int = 0  # the CRC the meta records of itself: this generation of the slot


def parse_meta(raw: bytes, run_id: str) -> dict[str, Any] | None:
    """The header in a meta file's bytes, or None when they are torn, corrupt or of another job."""
    if meta_crc(raw) is None:
        return None
    header = pickle.loads(raw[12:])
    return header if header.get("run_id") == run_id else None


class _Mapping:
    def __init__(self, path: Path, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self.size = size
        self.mm = mmap.mmap(self.fd, size) if size else None

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with the tensor
                pass
        os.close(self.fd)


class MemorySnapshots:
    """The snapshot directory of one node, seen from one worker."""

    def __init__(self, directory: Path, run_id: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self._maps: dict[int, _Mapping] = {}
        self._pinned: set[int] = set()
        self._lock = threading.Lock()
        self._slot_steps: dict[int, int | None] = {s: None for s in range(SLOTS)}
        for info in self.scan():
            self._slot_steps[info.slot] = info.step

    # -- shared state: writer side ----------------------------------------------------------
    def _data_path(self, slot: int) -> Path:
        return self.dir / f"shared.{slot}.data"

    def _meta_path(self, slot: int) -> Path:
        return self.dir / f"shared.{slot}.meta"

    def _choose(self, free: list[int]) -> int:
        """The slot to overwrite among ``free`` (unpinned): the empty or oldest one."""
        return min(free, key=lambda s: (self._slot_steps[s] is not None, self._slot_steps[s] or 0))

    def begin(self, nbytes: int) -> tuple[int, torch.Tensor, memoryview]:
        """Claim the oldest unpinned slot, invalidate it, and return it as a writable buffer."""
        with self._lock:
            slot = self._choose([s for s in range(SLOTS) if s not in self._pinned])
            self._slot_steps[slot] = None
        try:
            self._meta_path(slot).unlink()
        except FileNotFoundError:
            pass
        m = self._maps.get(slot)
        if m is None or m.size < nbytes:
            if m is not None:
                m.close()
            m = self._maps[slot] = _Mapping(self._data_path(slot), nbytes)
        if m.mm is None:
            return slot, torch.empty(0, dtype=torch.uint8), memoryview(b"")
        view = memoryview(m.mm)[:nbytes]
        return (
            slot,
            torch.frombuffer(view, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8),
            view,
        )

    def publish(self, slot: int, header: dict[str, Any]) -> int:
        """Mark ``slot`` complete: its data holds the state ``header`` describes.  Returns the meta's
        CRC (this generation of the slot, by which snapshot servers name it)."""
        body = pickle.dumps({**header, "run_id": self.run_id}, protocol=pickle.HIGHEST_PROTOCOL)
        crc = zlib.crc32(body)
        atomic_write(self._meta_path(slot), [META_MAGIC, struct.pack("<I", crc), body], False)
        with self._lock:
            self._slot_steps[slot] = header["step"]
        return crc

    def pin(self, slot: int) -> None:
        with self._lock:
            self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        with self._lock:
            self._pinned.discard(slot)

    def data_view(self, slot: int, nbytes: int) -> memoryview:
        """The bytes of a slot this process wrote (for persisting it to disk)."""
        m = self._maps[slot]
        return memoryview(m.mm)[:nbytes] if m.mm is not None else memoryview(b"")

    # -- shared state: reader side ----------------------------------------------------------
    def read_meta(self, slot: int) -> dict[str, Any] | None:
        """The header of a complete slot, or None when the slot is empty, torn, or foreign."""
        found = self._read_meta(slot)
        return found[0] if found is not None else None

    def _read_meta(self, slot: int) -> tuple[dict[str, Any], int] | None:
        try:
            raw = self._meta_path(slot).read_bytes()
        except FileNotFoundError:
            return None
        header = parse_meta(raw, self.run_id)
        if header is None:
            return None
        try:
            if self._data_path(slot).stat().st_size < header["nbytes"]:
                return None
        except FileNotFoundError:
            return None
        return header, struct.unpack("<I", raw[8:12])[0]

    def scan(self) -> list[SlotInfo]:
        """Complete snapshots on this node, newest first."""
        found = []
        for slot in range(SLOTS):
            meta = self._read_meta(slot)
            if meta is not None:
                header, crc = meta
                found.append(SlotInfo(slot, header["step"], header["world_size"], header, crc))
        return sorted(found, key=lambda i: -i.step)

    def read(self, info: SlotInfo) -> torch.Tensor:
        """A private (copy-on-write) view of a slot's bytes; the slot itself is never modified."""
        nbytes = info.header["nbytes"]
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with open(self._data_path(info.slot), "rb") as f:
            mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mm, dtype=torch.uint8)

    # -- per-rank RNG ----------------------------------------------------------------------------
    def _rng_path(self, rank: int, step: int) -> Path:
        return self.dir / f"rng.r{rank}.s{step}"

    def write_rng(self, rank: int, step: int, payload: bytes) -> None:
        atomic_write(self._rng_path(rank, step), [payload], False)
        try:
            self._rng_path(rank, step - RNG_KEEP).unlink()
        except FileNotFoundError:
            pass

    def scan_rng(self) -> dict[int, list[int]]:
        """``{rank: [steps]}`` of the RNG states stored on this node."""
        out: dict[int, list[int]] = {}
        for p in self.dir.glob("rng.r*.s*"):
            try:
                r, s = p.name[5:].split(".s")
                out.setdefault(int(r), []).append(int(s))
            except ValueError:
                continue
        return out

    def read_rng(self, rank: int, step: int) -> bytes | None:
        try:
            return self._rng_path(rank, step).read_bytes()
        except FileNotFoundError:
            return None

    def prune_rng(self, below_step: int) -> None:
        """Remove RNG files of any rank older than ``below_step`` (ranks that no longer exist)."""
        for rank, steps in self.scan_rng().items():
            for s in steps:
                if s < below_step:
                    try:
                        self._rng_path(rank, s).unlink()
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()
