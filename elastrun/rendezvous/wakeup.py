"""A wake-up for the agent's wait: a pipe whose read end turns readable when the rendezvous has news.

A backend's handler sets it from a thread of its own (a liveness link that saw its neighbour die, a
heartbeat that declared one) and returns its descriptor from ``wakeup_fileno()``: the agent's loop
waits on it beside its workers' descriptors and polls at once, instead of up to
``--monitor-interval`` later.  ``poll()`` clears it.
"""

from __future__ import annotations

import os


class Wakeup:
    """A pipe whose read end turns readable on :meth:`set` until :meth:`clear`: wakes a ``select`` loop."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._w, b"x")
        except OSError:  # full: already set
            pass

    def clear(self) -> None:
        if self._closed:
            return
        try:
            while os.read(self._r, 256):
                pass
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
