"""Memory for a rank's snapshot slots, allocated before the commits that fill them (issue 24).

A rank whose shard is new or bigger (a joiner, a survivor of a node loss, any rank after a
re-form to another world size) writes its first commits into slot files whose pages do not exist
yet: every 4 KiB of each slot is allocated and zeroed by a page fault inside the snapshot copy.
For a 600 MB shard that is 0.5-1 s per slot on two busy cores, in each of the first
:data:`~elastrun.train.snapshot.SLOTS` commits, on the training thread when the idle-priority
copy helper gets no CPU (measured with ``bench/bench_reform.py --fsdp``: the steps after a
re-form were slower than the first one).

:func:`reserve` allocates the slots' pages in the background instead, at ``SCHED_IDLE``
priority, with one ``fallocate(2)`` per slot (``FALLOC_FL_KEEP_SIZE``: the files' sizes, and
so what readers see, do not change; the pages are there when the copy extends the file and
writes into it).  Existing data is never touched: ``fallocate`` only fills holes.  Where the
directory's file system cannot do it (not tmpfs, not Linux), nothing happens.  Usage::

    reserve([slots._data_path(s) for s in range(SLOTS)], nbytes)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from elastrun.train.copier import at_idle_priority

#: ``fallocate(2)``'s flag that allocates without changing the file's size.
FALLOC_FL_KEEP_SIZE = 0x01

_libc: ctypes.CDLL | None = None


def _fallocate(fd: int, nbytes: int) -> bool:
    """Allocate ``[0, nbytes)`` of ``fd`` keeping its size; False where that is not possible."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return False
        _libc = ctypes.CDLL(name, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0


def allocated(path: Path) -> int:
    """Bytes of memory (or disk) the file holds, whatever its size says."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def reserve_now(paths: Sequence[Path], nbytes: int) -> int:
    """Allocate the first ``nbytes`` of every file in ``paths`` (created empty when missing) on this
    thread; returns how many files now hold that much."""
    done = 0
    for path in paths:
        if allocated(path) >= nbytes:
            done += 1
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            done += _fallocate(fd, nbytes)
        except (AttributeError, OSError):  # no fallocate in this libc
            pass
        finally:
            os.close(fd)
    return done


def reserve(paths: Sequence[Path], nbytes: int) -> threading.Thread | None:
    """:func:`reserve_now` on a daemon thread at idle priority (it only runs where a core would
    otherwise idle); returns the thread, or None when there is nothing to do."""
    todo = [p for p in paths if allocated(p) < nbytes]
    if not todo or nbytes <= 0:
        return None

    def run() -> None:
        with at_idle_priority():
            reserve_now(todo, nbytes)

    thread = threading.Thread(target=run, name="elastrun-reserve-slots", daemon=True)
    thread.start()
    return thread

