"""Crash-safe file writes: a file is either absent, the previous version, or the complete new one.

Every write goes to a temporary name in the same directory, is flushed (and fsync'ed when the file
must survive a machine crash), then renamed over the final name.  ``rename`` is atomic on POSIX file
systems, so a process killed at any byte leaves at worst a stray temporary file, never a torn file
under the final name.  Temporary names start with ``.tmp-`` so scanners can skip and prune them.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from pathlib import Path

TMP_PREFIX = ".tmp-"


def tmp_path_for(path: Path) -> Path:
    """A temporary sibling of ``path`` that no other process uses (pid in the name)."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview], durable: bool) -> tuple[int, int]:
    """Write ``chunks`` to ``path`` atomically; return ``(size, crc32)`` of what was written.

    ``durable`` adds the fsyncs a disk checkpoint needs (file, then directory); memory snapshots on
    tmpfs skip them, since tmpfs has nothing to flush and dies with the machine anyway.
    """
    tmp = tmp_path_for(path)
    size = 0
    crc = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)
    return size, crc


def file_crc32(path: Path, chunk_size: int = 8 << 20) -> tuple[int, int]:
    """``(size, crc32)`` of a whole file, read in chunks."""
    size = 0
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc
