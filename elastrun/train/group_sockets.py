"""The TCP connections of a worker's default process group, found by what its init opened.

A re-form's pause (:mod:`elastrun.train.reform`) must make a pending or later gloo collective fail
at once, even when the peer is alive but silent (SIGSTOPped): ``ProcessGroupGloo.abort()`` does not
wake a pending collective in torch 2.13, ``shutdown(2)`` on the group's sockets does.  This module
finds those sockets (by inode: the ones the group's init opened), shuts them down, and tells whether
a peer closed one (a collective that failed because a peer died).
"""

from __future__ import annotations

import os
import socket

from elastrun.shared.sockets import connected_tcp, socket_inodes


def _connected_tcp(fd: int) -> socket.socket | None:
    """A duplicate of ``fd`` if it is a connected (not listening) TCP socket, else None."""
    try:
        return connected_tcp(os.dup(fd))
    except OSError:
        return None


def _ended(fd: int) -> bool | None:
    """Whether connection ``fd`` reads end-of-file or an error (None: not a connected TCP socket)."""
    sock = _connected_tcp(fd)
    if sock is None:
        return None
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        sock.close()


class GroupSockets:
    """The TCP connections of the current default process group, found by what its init opened.

    Shutting a gloo listener down would abort the process (gloo's accept loop enforces success),
    so only connected sockets are touched.
    """

    def __init__(self) -> None:
        self._before: set[int] | None = None  # sockets that existed when the current init began
        self._group: set[int] = set()

    def init_begins(self) -> None:
        self._before = set(socket_inodes())
        self._group = set()

    def init_done(self) -> None:
        if self._before is not None:
            self._group = set(socket_inodes()) - self._before
        self._before = None

    def _targets(self) -> dict[int, int]:
        now = socket_inodes()
        if self._before is not None:  # during an init: whatever it opened so far
            return {i: fd for i, fd in now.items() if i not in self._before}
        return {i: fd for i, fd in now.items() if i in self._group}

    def shutdown(self) -> None:
        """Shut down every connection of the group: its pending and later collectives fail."""
        for fd in self._targets().values():
            sock = _connected_tcp(fd)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def connections_open(self) -> int | None:
        """How many of the group's connections could still carry a byte (None: it has none to watch).

        A connection shut down (by the pause), closed by its peer, failed or closed here is not open."""
        if not self._group:
            return None
        now = socket_inodes()
        return sum(1 for inode in self._group if inode in now and _ended(now[inode]) is False)

    def peer_lost(self) -> bool:
        """Whether a connection of the group was closed by its peer (or is gone)."""
        now = socket_inodes()
        return any(inode not in now or _ended(now[inode]) for inode in self._group)

    def forget(self) -> None:
        self._before = None
        self._group = set()
