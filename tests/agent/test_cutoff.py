"""A stopped worker is cut off its peers from outside before it is let run again (``cutoff.py``).

Real processes: a child holding a TCP connection to the test, a TCP listener and a Unix socket pair
is stopped; the agent's helper shuts its connection down from outside, and the test, its peer,
reads end-of-file while the child is still stopped.  Its listener and its Unix sockets are left as
they were.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from elastrun.agent.workers.cutoff import cut_tcp_connections

pytestmark = pytest.mark.e2e

_CHILD = """
import socket, sys, time
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(4)
a, b = socket.socketpair()
print(listener.getsockname()[1], flush=True)
time.sleep(120)
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0]


def test_a_stopped_process_is_cut_off_its_peers_and_keeps_its_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(server.getsockname()[1])], stdout=subprocess.PIPE,
                             text=True)
    conn = None
    try:
        listener_port = int(child.stdout.readline())
        conn, _ = server.accept()
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        cut = cut_tcp_connections(child.pid)
        if cut == 0:
            pytest.skip("pidfd_getfd(2) refused here (Linux < 5.6, or no ptrace access to the child)")
        assert cut == 1  # the connection; not the listener, not the Unix pair
        conn.settimeout(10)
        assert conn.recv(16) == b""  # end-of-file, from a process that has not run since it was stopped
        assert _state(child.pid) == "T"
        with socket.create_connection(("127.0.0.1", listener_port), timeout=10):
            pass  # its listener still takes connections (into its backlog, while it is stopped)
    finally:
        child.kill()
        child.wait(10)
        if conn is not None:
            conn.close()
        server.close()
    assert cut_tcp_connections(child.pid) == 0  # gone: nothing, no error
