"""Durable checkpoints in a directory every node can read (shared storage).

Layout: ``<checkpoint_dir>/step-<012d step>/`` holding

* ``shared.bin``: the replicated state (written by rank 0 only): magic, header length, pickled
  header, padding, then the flat tensor bytes (the same form as a memory snapshot slot);
* ``rng.r<rank>.pkl``: each rank's RNG states, written by that rank;
* ``manifest.json``: written by rank 0 last, once every piece is on disk; it names the step, the
  world size and every file with its size and CRC32.  A step directory without a valid manifest
  is incomplete and never used.

Every file is written atomically (temporary name, fsync, rename, fsync of the directory).  When a
file's size or checksum does not match the manifest, a warning names the file and an older
checkpoint is used.  Only the newest ``keep`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastrun.train import notes
from elastrun.train.blob import ALIGN
from elastrun.train.fileio import atomic_write, file_crc32

_MAGIC = b"ELSTATE1"
SHARED = "shared.bin"
MANIFEST = "manifest.json"


class CheckpointCorrupt(Exception):
    """A checkpoint file does not match its manifest."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint file {path} is corrupt: {reason}")
        self.path = path


@dataclass
class DiskCandidate:
    """A complete-looking checkpoint (sizes match its manifest; CRCs are checked on load)."""

    step: int
    world_size: int
    dir: Path
    files: dict[str, dict[str, int]]

    @property
    def rng_ranks(self) -> list[int]:
        return sorted(int(n[5:-4]) for n in self.files if n.startswith("rng.r"))


def rng_name(rank: int) -> str:
    return f"rng.r{rank}.pkl"


class CheckpointDir:
    """Writes and reads the checkpoints of one job."""

    def __init__(self, path: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.path = Path(path)
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.path / f"step-{step:012d}"

    # -- writing -----------------------------------------------------------------------------
    def write_shared(self, step: int, header: dict[str, Any], data: memoryview) -> tuple[int, int]:
        """Write the replicated state of ``step``; returns ``(size, crc32)`` for the manifest."""
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        prefix = _MAGIC + struct.pack("<Q", len(head)) + head
        prefix += b"\0" * (-len(prefix) % ALIGN)
        chunk = 16 << 20
        chunks = [prefix, *(data[i : i + chunk] for i in range(0, len(data), chunk))]
        return atomic_write(d / SHARED, chunks, True)

    def write_rng(self, step: int, rank: int, payload: bytes) -> None:
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / rng_name(rank), [payload], True)

    def write_manifest(self, step: int, world_size: int, shared: tuple[int, int], wait_s: float = 120.0,
                       abandon: threading.Event | None = None) -> bool:
        """Wait (bounded) for every rank's RNG file, then write the manifest and prune old steps.

        Returns False when some rank's file did not arrive in time, or ``abandon`` was set (the group
        that would write it is gone: a re-form): that step stays incomplete.
        """
        d = self.step_dir(step)
        deadline = time.monotonic() + wait_s
        names = [rng_name(r) for r in range(world_size)]
        while not all((d / n).exists() for n in names):
            if time.monotonic() > deadline or (abandon is not None and abandon.is_set()):
                missing = [n for n in names if not (d / n).exists()]
                why = ("did not arrive before the group re-formed" if abandon is not None and abandon.is_set()
                       else "never arrived")
                notes.warn(f"checkpoint step {step} left incomplete: {missing} {why}", stacklevel=2)
                return False
            time.sleep(0.02)
        files = {SHARED: {"size": shared[0], "crc32": shared[1]}}
        for n in names:
            size, crc = file_crc32(d / n)
            files[n] = {"size": size, "crc32": crc}
        body = json.dumps({"format": 1, "step": step, "world_size": world_size, "files": files}, indent=1)
        atomic_write(d / MANIFEST, [body.encode()], True)
        self.prune()
        return True

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop older ones and older incomplete ones."""
        complete = [c.step for c in self.scan(warn=False)]
        if not complete:
            return
        kept = set(sorted(complete, reverse=True)[: self.keep])
        newest = max(kept)
        for d in self._step_dirs():
            step = int(d.name[5:])
            # Older complete ones beyond ``keep`` go; incomplete ones older than the newest complete
            # step were abandoned; newer incomplete ones may still be being written.
            if step not in kept and (step in complete or step < newest):
                shutil.rmtree(d, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------
    def _step_dirs(self) -> list[Path]:
        if not self.path.is_dir():
            return []
        out = []
        for d in self.path.iterdir():
            if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit():
                out.append(d)
        return out

    def scan(self, warn: bool = True) -> list[DiskCandidate]:
        """Checkpoints whose manifest is valid and whose files have the right sizes, newest first."""
        found = []
        for d in self._step_dirs():
            mpath = d / MANIFEST
            if not mpath.exists():
                continue
            try:
                m = json.loads(mpath.read_text())
                step, ws, files = int(m["step"]), int(m["world_size"]), m["files"]
                if SHARED not in files:
                    raise ValueError(f"no {SHARED} entry")
            except (ValueError, KeyError, TypeError, OSError) as e:
                if warn:
                    notes.warn(
                        f"checkpoint manifest {mpath} is unreadable ({e}); ignoring that checkpoint",
                        stacklevel=2,
                    )
                continue
            bad = None
            for name, info in files.items():
                p = d / name
                size = p.stat().st_size if p.exists() else None
                if size != info["size"]:
                    what = "is missing" if size is None else f"has {size} bytes, the manifest says {info['size']}"
                    bad = f"checkpoint file {p} {what} (truncated?); using an older checkpoint"
                    break
            if bad:
                if warn:
                    notes.warn(bad, stacklevel=2)
                continue
            found.append(DiskCandidate(step, ws, d, files))
        return sorted(found, key=lambda c: -c.step)

    def load_shared(self, cand: DiskCandidate) -> tuple[dict[str, Any], torch.Tensor]:
        """Read and verify ``shared.bin``; returns the header and the tensor bytes."""
        p = cand.dir / SHARED
        expected = cand.files[SHARED]
        raw = bytearray(expected["size"])
        with open(p, "rb") as f:
            n = f.readinto(raw)
        if n != expected["size"]:
            raise CheckpointCorrupt(p, f"read {n} bytes, the manifest says {expected['size']}")
        crc = 0
        view = memoryview(raw)
        for i in range(0, len(raw), 16 << 20):
            crc = zlib.crc32(view[i : i + (16 << 20)], crc)
        if crc != expected["crc32"]:
            raise CheckpointCorrupt(p, f"CRC32 {crc:#010x} does not match the manifest's {expected['crc32']:#010x}")
        if raw[:8] != _MAGIC:
            raise CheckpointCorrupt(p, "bad magic")
        (hlen,) = struct.unpack("<Q", raw[8:16])
        header = pickle.loads(view[16 : 16 + hlen])
        start = 16 + hlen
        start += -start % ALIGN
        data = (
            torch.frombuffer(raw, dtype=torch.uint8, offset=start)
            if start < len(raw)
            else torch.empty(0, dtype=torch.uint8)
        )
        return header, data

    def load_rng(self, cand: DiskCandidate, rank: int) -> bytes | None:
        """A rank's RNG payload if present and intact (a bad one only warns: RNG is re-derived)."""
        name = rng_name(rank)
        if name not in cand.files:
            return None
        p = cand.dir / name
        try:
            payload = p.read_bytes()
        except OSError:
            return None
        if zlib.crc32(payload) != cand.files[name]["crc32"]:
            notes.warn(f"checkpoint file {p} is corrupt (CRC mismatch); re-deriving that rank's RNG", stacklevel=2)
            return None
        return payload
