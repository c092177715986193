"""Waking a thread when a file of a given name appears in a directory (Linux inotify, via libc).

The replicator waits for the workers' push requests.  Polling the directory every few tens of
milliseconds in every agent costs a ``listdir`` each time, all job long; with inotify the kernel
says when a request was renamed into place.  Where inotify is not available (another platform, a
directory that does not exist yet, the watch limit reached) the caller polls as before::

    watch = Watch(directory, re.compile(r"push\\..*\\.json"), event)
    while ...:
        event.wait(watch.timeout)   # set by the watch; a timeout is only a safety net
        event.clear()
        ...
    watch.close()
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import struct
import threading
from pathlib import Path

#: Seconds between looks without inotify.
POLL = 0.05
#: Seconds between looks with inotify (a safety net: a request is found even if an event was lost).
SAFETY = 2.0

_IN_CLOSE_WRITE = 0x00000008
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_Q_OVERFLOW = 0x00004000
_EVENT = struct.Struct("iIII")


class Watch:
    """Sets ``event`` whenever a file whose name matches ``names`` is created, renamed into or written
    in ``directory``; :attr:`timeout` is how long a waiter should wait before it looks anyway."""

    def __init__(self, directory: Path, names: re.Pattern[str], event: threading.Event) -> None:
        self.timeout = POLL
        self._names = names
        self._event = event
        self._closed = False
        self._fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return
        if fd < 0:
            return
        mask = _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
        if libc.inotify_add_watch(fd, os.fsencode(str(directory)), mask) < 0:
            os.close(fd)
            return
        self._fd = fd
        self.timeout = SAFETY
        self._thread = threading.Thread(target=self._read, name="elastrun-dirwatch", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether the kernel watches the directory (else the waiter polls every :data:`POLL` s)."""
        return self._fd >= 0

    def _read(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._fd], [], [], 0.5)
                if not ready:
                    continue
                buf = os.read(self._fd, 64 * 1024)
            except (OSError, ValueError):
                return  # closed
            at = 0
            while at + _EVENT.size <= len(buf):
                _, mask, _, n = _EVENT.unpack_from(buf, at)
                name = buf[at + _EVENT.size : at + _EVENT.size + n].split(b"\0", 1)[0].decode(errors="replace")
                at += _EVENT.size + n
                if mask & _IN_Q_OVERFLOW or self._names.fullmatch(name):
                    self._event.set()

    def close(self) -> None:
        self._closed = True
        if self._fd >= 0:
            self._thread.join(2)
            os.close(self._fd)
            self._fd = -1
