"""The device seam of the snapshot pipeline: streams, events, copies and page-locked memory.

The pipeline orders its copies against training with events, never with a wait on the whole
device: the training stream (whatever stream is current when ``commit()`` runs) records an event,
the pipeline's side stream waits for it on the device, copies, and records its own; the training
stream waits for that one (again on the device) only before ``optimizer.step()`` changes what is
being copied.  The host waits for a copy only to publish it, on a helper thread::

    ready = dev.record()                  # the training stream, just after optimizer.step()
    dev.wait(ready, dev.side)             # the side stream starts from there
    dev.copy([dst], [src], dev.side)      # queued on the device, not run
    done = dev.record(dev.side)
    dev.wait(done)                        # in the optimizer's pre-hook: the device waits, not the host
    dev.sync(done)                        # a helper thread, before it publishes the snapshot

:class:`CudaDevice` is the one implementation; the unit tests drive a stand-in with the same
methods (``tests/train/fake_device.py``) to check what waits for what.
"""

from __future__ import annotations

import abc
import time
from typing import Any

import torch

#: Left free on the device beyond a staging buffer: at least this much, or a tenth of the card.
STAGING_MARGIN = 2 << 30
#: How often :meth:`Device.sync`'s default looks whether an event has passed.
POLL_S = 0.0005
#: Host memory is page-locked in pieces that end at absolute multiples of this many bytes (see
#: ``slotmem.SlotMemory.pin``), and a copy to or from it is cut at the same addresses: one copy never
#: spans two registrations.
PIN_CHUNK = 64 << 20


def pin_pieces(address: int, nbytes: int) -> list[tuple[int, int]]:
    """``(address, nbytes)`` of each piece of ``[address, address + nbytes)`` cut at the absolute
    multiples of :data:`PIN_CHUNK`."""
    out, at, end = [], address, address + nbytes
    while at < end:
        cut = min(end, (at // PIN_CHUNK + 1) * PIN_CHUNK)
        out.append((at, cut - at))
        at = cut
    return out


def _host_pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``dst <- src`` as copies that each stay inside one page-locked piece of the host side (flat
    ``uint8`` views, as the pipeline's copies are; anything else is one copy)."""
    host = dst if dst.device.type == "cpu" else src
    if host.device.type != "cpu" or dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1:
        return [(dst, src)]
    pieces = pin_pieces(host.data_ptr(), host.numel())
    if len(pieces) == 1:
        return [(dst, src)]
    out, at = [], 0
    for _, n in pieces:
        out.append((dst[at : at + n], src[at : at + n]))
        at += n
    return out


class Device(abc.ABC):
    """One accelerator of this process, as the snapshot pipeline uses it."""

    #: The pipeline's own stream.
    side: Any
    #: What :meth:`pin` and :meth:`staging` last refused, for the one warning line that says so.
    why_not: str = ""

    @abc.abstractmethod
    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on this device (its copies are this seam's)."""

    @abc.abstractmethod
    def record(self, stream: Any = None) -> Any:
        """An event at the point ``stream`` (default: the current one) has reached in its queue."""

    @abc.abstractmethod
    def wait(self, event: Any, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait, on the device, for ``event``."""

    @abc.abstractmethod
    def done(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (never blocks)."""

    def sync(self, event: Any) -> None:
        """Block the calling (helper) thread until the device has passed ``event``."""
        while not self.done(event):
            time.sleep(POLL_S)

    @abc.abstractmethod
    def seconds(self, start: Any, end: Any) -> float:
        """Device time from ``start`` to ``end`` (both passed)."""

    @abc.abstractmethod
    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], stream: Any) -> None:
        """Queue ``dst[i] <- src[i]`` (same byte sizes) on ``stream``; returns at once when the host
        side of each copy is a device buffer or page-locked memory."""

    @abc.abstractmethod
    def staging(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` buffer of ``nbytes`` on the device, or None when the card has no room for one
        beside training (the reason in :attr:`why_not`)."""

    @abc.abstractmethod
    def pin(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory for copies at the device's speed (False, reason in :attr:`why_not`)."""

    @abc.abstractmethod
    def unpin(self, address: int) -> None:
        """Undo :meth:`pin` (before the memory is unmapped)."""

    def activate(self) -> None:
        """Make the calling (helper) thread use this device."""


class CudaDevice(Device):
    """One CUDA device (``index``) through torch."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.side = torch.cuda.Stream(device=index)

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def record(self, stream: Any = None) -> Any:
        # blocking: a thread that syncs on it sleeps in the driver (no spinning core), without the GIL
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.index))
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.index)).wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def sync(self, event: Any) -> None:
        """Sleeps in the driver until the event has passed, the interpreter lock let go (a helper
        thread that polled every half millisecond took the lock from the training thread 60-250
        times per snapshot)."""
        event.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], stream: Any) -> None:
        if not dst:
            return
        with torch.cuda.stream(stream):
            if all(d.device.type == "cuda" for d in dst) and hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(dst, src, non_blocking=True)  # few kernels for many tensors
            else:
                for d, s in zip(dst, src, strict=True):
                    for piece_d, piece_s in _host_pieces(d, s):
                        piece_d.copy_(piece_s, non_blocking=True)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """Room is what the device has free plus what torch's allocator holds beyond the peak the
        steps so far used, less a margin (2 GiB or a tenth of the card): the buffer must never be
        what makes a later step run out of memory."""
        free, total = torch.cuda.mem_get_info(self.index)
        slack = max(0, torch.cuda.memory_reserved(self.index) - torch.cuda.max_memory_allocated(self.index))
        room = free + slack - max(STAGING_MARGIN, total // 10)
        if nbytes > room:
            self.why_not = (f"the card has {max(room, 0) / 1e9:.1f} GB to spare beside training, the state needs "
                            f"{nbytes / 1e9:.1f} GB")  # fmt: skip
            return None
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", self.index))
        except torch.cuda.OutOfMemoryError as e:
            self.why_not = f"allocating it failed ({str(e).splitlines()[0]})"
            return None

    def pin(self, address: int, nbytes: int) -> bool:
        rc = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))  # 1: cudaHostRegisterPortable
        if rc != 0:
            try:
                name = torch.cuda.cudart().cudaGetErrorString(rc)
            except (AttributeError, RuntimeError, TypeError):
                name = ""
            self.why_not = f"cudaHostRegister refused it (error {rc}{': ' + str(name) if name else ''})"
            return False
        return True

    def unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)

    def activate(self) -> None:
        torch.cuda.set_device(self.index)


_devices: dict[int, CudaDevice] = {}


def device_of(tensors: list[torch.Tensor]) -> Device | None:
    """The device the snapshot pipeline copies ``tensors`` from (the first CUDA one's), or None
    when all of them are in host memory."""
    for t in tensors:
        if t.device.type == "cuda":
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            if index not in _devices:
                _devices[index] = CudaDevice(index)
            return _devices[index]
    return None
