"""The connected TCP sockets among a process's descriptors: the ones a shutdown from a copy may touch.

Both sides shut connections down through a copy of a descriptor: a worker those of its own process group
(:mod:`elastrun.train.reform`, copies from ``os.dup``), an agent those of a stopped worker before it lets it
run for its dump (:mod:`elastrun.agent.workers.cutoff`, copies from ``pidfd_getfd``).  A listening socket is
never one of them: gloo aborts its process when its accept loop fails.
"""

from __future__ import annotations

import os
import socket


def socket_inodes(pid: int | str = "self") -> dict[int, int]:
    """``{inode: fd}`` of the sockets of process ``pid`` (this one by default); {} when unreadable."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def connected_tcp(fd: int) -> socket.socket | None:
    """A socket object that owns descriptor ``fd`` if that is a connected TCP socket (not a listener), else
    None, with ``fd`` closed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        return None
    try:
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.getpeername()
            return sock
    except OSError:  # not connected
        pass
    sock.close()
    return None
