"""A stand-in for a GPU that the pipeline's unit tests drive by hand (``elastrun.train.gpu.device.Device``).

Its "device memory" is host memory: a tensor counts as on the device once :meth:`FakeDevice.adopt`
has named it.  Nothing it is asked to do runs when asked: copies, waits and event records are queued
on their stream, and run only when the test calls :meth:`FakeDevice.run` for that stream, in order,
stopping at a wait whose event has not passed.  So a test sees exactly what waits for what.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from elastrun.train.gpu.device import Device


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.passed = False
        self.at = 0.0  # the fake clock when it passed


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque[tuple[str, Any]] = deque()


class FakeDevice(Device):
    """See the module docstring.  ``pinnable``: whether :meth:`pin` succeeds; ``room``: the largest
    staging buffer it gives (0: none)."""

    def __init__(self, pinnable: bool = True, room: int = 1 << 30) -> None:
        self.train = FakeStream("train")
        self.side = FakeStream("side")
        self.pinnable = pinnable
        self.room = room
        self.clock = 0.0
        self.log: list[str] = []  # what ran, in order
        self.pinned: dict[int, int] = {}
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._count = 0

    # -- the tests' side -----------------------------------------------------------------------
    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` as living on this device."""
        self._ids.add(t.untyped_storage().data_ptr())
        return t

    def enqueue(self, name: str, fn: Callable[[], None], stream: FakeStream | None = None) -> None:
        """Queue the training program's own work (an optimizer step, say) on a stream."""
        with self._lock:
            (stream or self.train).ops.append(("work", (name, fn)))

    def run(self, stream: FakeStream, until: FakeEvent | None = None, tick: float = 1.0) -> bool:
        """Run ``stream``'s queue in order (each op advances the clock by ``tick``) until it is empty,
        ``until`` has passed, or a wait blocks; True when the queue is empty."""
        while True:
            with self._lock:
                if not stream.ops or (until is not None and until.passed):
                    return not stream.ops
                kind, arg = stream.ops[0]
                if kind == "wait" and not arg.passed:
                    return False
                stream.ops.popleft()
            self.clock += tick
            if kind == "record":
                arg.passed, arg.at = True, self.clock
                self.log.append(f"{stream.name}: {arg.name}")
            elif kind == "copy":
                for d, s in zip(*arg, strict=True):
                    d.copy_(s)
                self.log.append(f"{stream.name}: copy {sum(d.numel() for d in arg[0])} bytes")
            elif kind == "work":
                arg[1]()
                self.log.append(f"{stream.name}: {arg[0]}")
            elif kind == "wait":
                self.log.append(f"{stream.name}: waited for {arg.name}")

    def queued(self, stream: FakeStream) -> list[str]:
        with self._lock:
            return [f"{k} {a.name}" if k in ("wait", "record") else f"{k}" for k, a in stream.ops]

    # -- the Device contract -------------------------------------------------------------------
    def holds(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._ids

    def record(self, stream: Any = None) -> FakeEvent:
        with self._lock:
            self._count += 1
            event = FakeEvent(f"event{self._count}")
            (stream or self.train).ops.append(("record", event))
        return event

    def wait(self, event: Any, stream: Any = None) -> None:
        with self._lock:
            (stream or self.train).ops.append(("wait", event))

    def done(self, event: Any) -> bool:
        return bool(event.passed)

    def seconds(self, start: Any, end: Any) -> float:
        return end.at - start.at

    def copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], stream: Any) -> None:
        with self._lock:
            stream.ops.append(("copy", (list(dst), [s.clone() if not self.holds(s) else s for s in src])))

    def staging(self, nbytes: int) -> torch.Tensor | None:
        if nbytes > self.room:
            self.why_not = f"no room for {nbytes} bytes"
            return None
        return self.adopt(torch.zeros(nbytes, dtype=torch.uint8))

    def pin(self, address: int, nbytes: int) -> bool:
        if not self.pinnable:
            self.why_not = "the fake device refuses to page-lock"
            return False
        self.pinned[address] = nbytes
        return True

    def unpin(self, address: int) -> None:
        self.pinned.pop(address, None)
