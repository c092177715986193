"""One snapshot's device tensors copied into its host slot, beside the next step.

Two ways, chosen per job by the pipeline:

* **staged** (the card has room for a copy of the state): on the side stream, one device-to-device
  copy of every tensor into a staging buffer laid out like the slot (a few milliseconds at the
  card's memory bandwidth), then device-to-host copies of whole runs of it into the slot.  The
  optimizer waits only for the first part: the slow copy over the bus overlaps as many steps as it
  takes, and the staging buffer is reused by the next snapshot only after it (stream order).
* **direct**: device-to-host copies from the tensors themselves; the optimizer waits for all of it.

Into page-locked slot memory both are queued on the device and return at once.  Into pageable
memory a device-to-host copy holds its caller until it has finished, so there the host half
(:meth:`DeviceCopy.to_host`) runs on the pipeline's helper thread, never on the training thread.

Usage (``pipeline.py``)::

    job = DeviceCopy(dev, flat, indices, host, staging)
    job.start(pinned)          # training thread, in commit(): queues the copies
    job.guard()                # optimizer pre-hook: the training stream waits for what it changes
    job.to_host()              # helper thread, when not ``pinned``: the slow half, blocking
    job.wait()                 # helper thread: the bytes are in the slot
"""

from __future__ import annotations

from typing import Any

import torch

from elastrun.train.blob import Flattened, as_bytes
from elastrun.train.gpu.device import Device


def runs(flat: Flattened, indices: list[int]) -> list[tuple[int, int]]:
    """Byte ranges ``(start, end)`` of the slot covered by consecutive device entries of ``flat``
    (``indices``): each range is one copy between a staging buffer laid out like the slot and the
    slot (the padding between entries comes along; entries on the host break a range)."""
    on_device = set(indices)
    out: list[tuple[int, int]] = []
    current: list[int] | None = None
    for i, e in enumerate(flat.entries):
        if not e.nbytes:
            continue
        if i in on_device:
            if current is None:
                current = [e.offset, e.offset + e.nbytes]
            else:
                current[1] = e.offset + e.nbytes
        elif current is not None:
            out.append((current[0], current[1]))
            current = None
    if current is not None:
        out.append((current[0], current[1]))
    return out


class DeviceCopy:
    """The device half of one snapshot (see the module docstring)."""

    def __init__(self, dev: Device, flat: Flattened, indices: list[int], host: torch.Tensor,
                 staging: torch.Tensor | None) -> None:  # fmt: skip
        self.dev = dev
        self.flat = flat  # keeps the sources (and any clone made for this snapshot) alive until done
        self.indices = [i for i in indices if flat.entries[i].nbytes]
        self.host = host
        self.staging = staging
        self.nbytes = sum(flat.entries[i].nbytes for i in self.indices)
        self.ready: Any = None  # the training stream after the step being snapshotted
        self.staged: Any = None  # what optimizer.step() must wait for
        self.done: Any = None  # the bytes are in the slot
        self.needed: Any = None  # where the training stream reached optimizer.step()
        self._sources: list[torch.Tensor] = []

    def start(self, pinned: bool) -> None:
        """Queue the copies after what the training stream has queued so far; the host half too
        when the slot is page-locked (else :meth:`to_host`, on a helper thread)."""
        dev, entries = self.dev, self.flat.entries
        self._sources = [as_bytes(self.flat.tensors[i]) for i in self.indices]  # before ready: a
        self.ready = dev.record()  # non-contiguous tensor's contiguous copy is queued on this stream
        dev.wait(self.ready, dev.side)
        if self.staging is not None:
            dev.copy([self.staging[entries[i].offset : entries[i].offset + entries[i].nbytes] for i in self.indices],
                     self._sources, dev.side)  # fmt: skip
            self.staged = dev.record(dev.side)
            if pinned:
                self.to_host()
        elif pinned:
            dev.copy([self.host[entries[i].offset : entries[i].offset + entries[i].nbytes] for i in self.indices],
                     self._sources, dev.side)  # fmt: skip
            self.staged = self.done = dev.record(dev.side)

    def to_host(self) -> None:
        """The device-to-host half: from the staging buffer, or (direct, pageable) from the tensors.
        Into pageable memory each copy returns only when it has landed."""
        dev = self.dev
        if self.staging is not None:
            spans = runs(self.flat, self.indices)
            dev.copy([self.host[a:b] for a, b in spans], [self.staging[a:b] for a, b in spans], dev.side)
        else:
            entries = self.flat.entries
            dev.copy([self.host[entries[i].offset : entries[i].offset + entries[i].nbytes] for i in self.indices],
                     self._sources, dev.side)  # fmt: skip
        self.done = dev.record(dev.side)
        if self.staged is None:
            self.staged = self.done

    def guard(self) -> None:
        """Make the training stream wait, on the device, until what ``optimizer.step()`` is about
        to change has been copied (the staging copy, or the whole copy when direct)."""
        dev = self.dev
        self.needed = dev.record()
        dev.wait(self.staged)

    def landed(self) -> bool:
        return self.done is not None and self.dev.done(self.done)

    def wait(self) -> None:
        """Block the calling (helper) thread until the bytes are in the slot."""
        self.dev.sync(self.done)
        self._sources = []

    def timings(self) -> dict[str, float]:
        """Device seconds: ``stage`` (the device-to-device copy), ``copy`` (until the bytes landed)
        and ``stall`` (how long ``optimizer.step()`` waited for it; 0 if it did not)."""
        dev = self.dev
        out = {"copy": dev.seconds(self.ready, self.done),
               "stage": dev.seconds(self.ready, self.staged) if self.staging is not None else 0.0}  # fmt: skip
        out["stall"] = max(0.0, dev.seconds(self.needed, self.staged)) if self.needed is not None else 0.0
        return out
