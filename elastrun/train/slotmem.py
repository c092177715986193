"""Memory for snapshot slots, made ready before the commits that fill it.

A slot written for the first time pays, inside its copy, one page fault per 4 KiB: the page is
allocated and zeroed then.  Measured: 0.5-1 s for a 600 MB shard on two busy cores, and 1.5-2.0 s
per step while a GPU job's four 1 GB slots were first written.  And a GPU copies into pageable
memory at a fifth of its speed into page-locked memory (11 against 55 GB/s on an H100).

So each slot file's mapping (:class:`SlotMemory`) is made ready on a helper thread as soon as the
state's size is known (:meth:`SlotMemory.make`):

1. ``fallocate(2)`` of the file: its pages exist (existing data is never touched: only holes are
   filled; the file's size, which readers compare with a slot's meta, is set by step 2);
2. ``mmap`` with ``MAP_POPULATE``: the page tables are filled too;
3. for a GPU state, ``cudaHostRegister`` of the mapping (page-locked, so the GPU's copy engines
   write into it directly).  Where that is refused (an unprivileged container, a locked-memory
   limit) the slot stays pageable and the caller says so once.

Registering a mapping whole stalled the training thread: while three 4 GB slots were registered,
one step took 3.0-4.1 s on an H100 and an H200 (1.4-1.9 s for three 1.5 GB slots), about the
registrations' own time (torch lets the interpreter lock go around ``cudaHostRegister``, so the
training thread's CUDA calls most likely waited on the driver's lock).  So a mapping is registered
in pieces (``PIN_CHUNK``, cut at absolute addresses so that a copy can be cut the same way), one
piece at a time in the process, each followed by a pause as long as it took: the training thread
waits for one piece at most.

Page-locked memory is held until the mapping is closed; the pages of ``/dev/shm`` count against the
host's memory (and a container's memory limit) whether locked or not.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

from elastrun.train.gpu.device import pin_pieces

#: ``fallocate(2)``'s flag that allocates without changing the file's size.
FALLOC_FL_KEEP_SIZE = 0x01

_libc: ctypes.CDLL | None = None
#: One registration at a time in this process (the slots are made on one thread each).
_pin_lock = threading.Lock()
#: The longest pause after a piece (a piece normally takes 10-30 ms).
PIN_PAUSE_MAX_S = 0.1


def fallocate(fd: int, nbytes: int) -> bool:
    """Allocate ``[0, nbytes)`` of ``fd`` keeping its size; False where that is not possible."""
    global _libc
    if _libc is None:
        # The C library already loaded in this process (as prctl.py takes it), not
        # ``ctypes.util.find_library("c")``: that runs ``ldconfig -p`` (or gcc) as a child process,
        # from a training worker's helper thread at its first commit.
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    try:
        return _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0
    except AttributeError:  # no fallocate in this libc
        return False


def allocated(path: Path) -> int:
    """Bytes of memory (or disk) the file holds, whatever its size says."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def address(mm: mmap.mmap) -> int:
    """The address of a mapping's first byte (the ctypes view is let go at once: the mapping
    can still be closed)."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


class SlotMemory:
    """One slot file, mapped read-write; optionally made ready ahead (:meth:`make`)."""

    def __init__(self, path: Path, size: int, ready: bool = False) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if ready and size:
                fallocate(self.fd, size)
            if os.fstat(self.fd).st_size < size:
                os.ftruncate(self.fd, size)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if ready else 0)
            self.mm = mmap.mmap(self.fd, size, flags=flags) if size else None
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.ready = ready  # allocated and mapped ahead of its first write
        self._pinned_by: Any = None  # the device it is page-locked for
        self._pieces: list[int] = []  # the addresses of its registered pieces

    @classmethod
    def make(cls, path: Path, size: int, device: Any = None) -> SlotMemory:
        """A slot made ready before use: allocated, its page tables filled, and page-locked for
        ``device`` (a :class:`~elastrun.train.gpu.device.Device`) where that is allowed."""
        mem = cls(path, size, ready=True)
        if device is not None and mem.mm is not None:
            mem.pin(device)
        return mem

    def pin(self, device: Any) -> bool:
        """Page-lock the mapping for ``device``, piece by piece (see the module docstring); False (the
        reason in ``device.why_not``, nothing left locked) if refused."""
        if self._pinned_by is not None or self.mm is None:
            return self._pinned_by is not None
        for at, n in pin_pieces(address(self.mm), self.size):
            with _pin_lock:
                began = time.monotonic()
                ok = device.pin(at, n)
                if ok:
                    self._pieces.append(at)
                    time.sleep(min(PIN_PAUSE_MAX_S, time.monotonic() - began))  # the training thread's turn
            if not ok:
                self._unpin(device)
                return False
        self._pinned_by = device
        return True

    def _unpin(self, device: Any) -> None:
        for at in self._pieces:
            device.unpin(at)
        self._pieces = []

    @property
    def pinned(self) -> bool:
        return self._pinned_by is not None

    def close(self) -> None:
        if self.mm is not None:
            if self._pinned_by is not None:
                self._unpin(self._pinned_by)
                self._pinned_by = None
            try:
                self.mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with the tensor
                pass
        os.close(self.fd)
