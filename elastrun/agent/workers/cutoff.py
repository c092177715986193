"""Cutting a stopped worker off its peers before it is let run again.

A hung worker that is frozen (SIGSTOP, a debugger) is dumped with SIGABRT, and its dump needs SIGCONT,
which lets every thread of it run again for the moment the dump takes.  Its collectives then go on with
the peers it stopped in the middle of, on this node and on others, until it dies, and a peer caught in
that exchange was seen stuck in a gloo send that nothing ended (docs/train.md, "Hangs, pre-emption,
budget").  So before the SIGCONT, its agent shuts down each of its connected TCP sockets from outside:
its peers see their connection end while it still sends nothing, and fail their collective cleanly.

The agent takes a copy of each descriptor with ``pidfd_getfd(2)`` (Linux 5.6), which needs ptrace access
to the worker (the agent is its ancestor; root, or no Yama restriction, or ``CAP_SYS_PTRACE``).  Where
that is refused nothing is cut, and the agent still pauses this node's other workers before the SIGCONT
(:meth:`elastrun.agent.group.WorkerGroup.end`).  Listening and Unix sockets (the control channel) are left
alone (:func:`elastrun.shared.sockets.connected_tcp`).

Example::

    from elastrun.agent.workers.cutoff import cut_tcp_connections

    os.kill(pid, signal.SIGSTOP)
    cut_tcp_connections(pid)        # its peers read end-of-file now; it keeps its descriptors
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket

from elastrun.shared.sockets import connected_tcp, socket_inodes

#: ``pidfd_getfd``'s number: the same on every architecture (Linux 5.6's common system-call table).
SYS_PIDFD_GETFD = 438


def _getfd(pidfd: int, fd: int) -> int:
    """A copy of descriptor ``fd`` of the process behind ``pidfd`` in this process; -errno on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd), ctypes.c_uint(0))
    return got if got >= 0 else -ctypes.get_errno()


def cut_tcp_connections(pid: int) -> int:
    """Shut down (both ways) every connected TCP socket of process ``pid``, which keeps its descriptors:
    how many.  0 where the platform or the permissions do not allow it, or the process is gone."""
    fds = socket_inodes(pid).values()
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone, or no pidfd_open (Linux < 5.3, Python < 3.9)
        return 0
    cut = 0
    try:
        for target in fds:
            fd = _getfd(pidfd, target)
            if fd in (-errno.EPERM, -errno.ENOSYS, -errno.EACCES):
                return cut  # not allowed here: the same for every other descriptor
            if fd < 0:
                continue  # closed meanwhile
            sock = connected_tcp(fd)
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
            finally:
                sock.close()
    finally:
        os.close(pidfd)
    return cut
