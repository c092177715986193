"""Restores onto a GPU at the card's speed: host bytes to device tensors through page-locked buffers.

A snapshot's bytes are in node memory (a slot file) or in a host buffer (from a peer, from disk).
A plain ``gpu_tensor.copy_(host_view)`` from pageable memory runs at a fifth of the card's speed
and holds the thread for each tensor.  :func:`load` instead cuts the work into pieces and runs
:data:`LANES` lanes at once, each with a page-locked buffer and a stream of its own: a lane reads a
piece into its buffer (``pread`` from the file, with the interpreter lock released; or a
``memmove`` from host memory) and queues its copy to the device, then reads its next piece while
that copy runs.  The reads run on several cores; the copies keep the bus busy.

Usage::

    load([Piece(dst_bytes, offset, nbytes)], source)      # source: a file path or a host uint8 tensor
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from elastrun.train.blob import as_bytes, check, entry_layout, tree_of

#: Lanes at once (at most: one per core), and each one's page-locked buffer (bytes).
LANES = 16
BUFFER = 8 << 20

_buffers: dict[int, list[torch.Tensor]] = {}  # device index -> the lanes' buffers (made once per process)
_lock = threading.Lock()


@dataclass
class Piece:
    """``nbytes`` bytes at ``offset`` of the source land in ``dst``: a contiguous ``uint8`` view of
    a device tensor's memory, exactly ``nbytes`` long."""

    dst: torch.Tensor
    offset: int
    nbytes: int


def _lane_buffers(device: torch.device, lanes: int) -> list[torch.Tensor]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        have = _buffers.setdefault(index, [])
        while len(have) < lanes:
            have.append(torch.empty(BUFFER, dtype=torch.uint8, pin_memory=True))
        return have[:lanes]


def _buffer_view(buf: torch.Tensor, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")


def split(pieces: list[Piece], size: int = BUFFER) -> list[Piece]:
    """The pieces cut to at most ``size`` bytes each (a lane's buffer)."""
    out = []
    for p in pieces:
        for lo in range(0, p.nbytes, size):
            n = min(size, p.nbytes - lo)
            out.append(Piece(p.dst[lo : lo + n], p.offset + lo, n))
    return out


def load(pieces: list[Piece], source: str | os.PathLike | torch.Tensor, lanes: int = LANES) -> int:
    """Fill every piece's ``dst`` from ``source`` (a file, read with ``pread``, or a host ``uint8``
    tensor); returns the bytes moved.  The current stream waits, on the device, for every copy:
    what the caller queues next sees the bytes; the host waits only for the lanes' last copies."""
    work = [p for p in split(pieces) if p.nbytes]
    if not work:
        return 0
    device = work[0].dst.device
    lanes = max(1, min(lanes, len(work), os.cpu_count() or 1))
    buffers = _lane_buffers(device, lanes)
    fd = os.open(source, os.O_RDONLY) if not isinstance(source, torch.Tensor) else -1
    errors: list[BaseException] = []
    events: list[torch.cuda.Event] = []
    try:
        def lane(k: int) -> None:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device=device)
            buf, done = buffers[k], None
            try:
                for p in work[k::lanes]:
                    if done is not None:
                        done.synchronize()  # the buffer's last copy has left it
                    if fd >= 0:
                        view = _buffer_view(buf, p.nbytes)
                        got = 0
                        while got < p.nbytes:
                            n = os.preadv(fd, [view[got:]], p.offset + got)
                            if n <= 0:
                                raise OSError(f"{source}: ended at byte {p.offset + got} of {p.offset + p.nbytes}")
                            got += n
                    else:
                        ctypes.memmove(buf.data_ptr(), source.data_ptr() + p.offset, p.nbytes)  # type: ignore[union-attr]
                    with torch.cuda.stream(stream):
                        p.dst.copy_(buf[: p.nbytes], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(stream)
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)
            if done is not None:
                done.synchronize()  # the buffer is free for the next load
                events.append(done)

        threads = [threading.Thread(target=lane, args=(k,), name=f"elastrun-load-{k}", daemon=True)
                   for k in range(lanes)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if fd >= 0:
            os.close(fd)
    if errors:
        raise errors[0]
    current = torch.cuda.current_stream(device)
    for e in events:
        current.wait_event(e)
    return sum(p.nbytes for p in work)


def materialize(header: dict[str, Any], source: str | os.PathLike | torch.Tensor, into: dict[int, torch.Tensor],
                device: torch.device) -> Any:  # fmt: skip
    """:func:`elastrun.train.blob.materialize` for a GPU state: the entries that were on the device
    when they were snapshotted (the header's ``devices``) come back onto ``device``, straight into
    ``into``'s tensors where given (a model's own parameters) and through :func:`load`; the rest
    (host tensors of the state) into host memory."""
    check(header)
    devices = header.get("devices") or ["cpu"] * len(header["entries"])
    tensors: list[torch.Tensor] = []
    pieces: list[Piece] = []
    host: list[tuple[torch.Tensor, int, int]] = []
    for i, entry in enumerate(header["entries"]):
        dtype, shape, offset, nbytes = entry_layout(entry)
        t = into.get(i)
        if t is None:
            t = torch.empty(shape, dtype=dtype, device=device if devices[i] != "cpu" else "cpu")
        tensors.append(t)
        if not nbytes:
            continue
        if t.device.type == "cpu":
            host.append((t, offset, nbytes))
        else:
            pieces.append(Piece(as_bytes(t), offset, nbytes))
    load(pieces, source)
    if host:
        fd = os.open(source, os.O_RDONLY) if not isinstance(source, torch.Tensor) else -1
        try:
            for t, offset, nbytes in host:
                view = memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
                if fd >= 0:
                    if os.preadv(fd, [view], offset) != nbytes:
                        raise OSError(f"{source}: shorter than its header says")
                else:
                    ctypes.memmove(t.data_ptr(), source.data_ptr() + offset, nbytes)  # type: ignore[union-attr]
        finally:
            if fd >= 0:
                os.close(fd)
    return tree_of(header, tensors)
