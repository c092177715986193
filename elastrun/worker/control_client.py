"""The worker's end of the control channel to its agent (in-process re-forms, ``elastrun.train.run``).

The agent's end is :class:`elastrun.agent.workers.control_server.ControlServer`; the messages and their framing
are in :mod:`elastrun.shared.protocol`.  A message from the agent that this worker does not understand is
refused: the worker says why on its stderr and leaves the channel (``on_message(None)``, as if the
agent had closed it), so it is restarted rather than re-formed.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable

from elastrun.shared.protocol import SOCKET_ENV, TO_WORKER, Hello, LineReader, ProtocolError, ToAgent, ToWorker, encode

OnMessage = Callable[[ToWorker | None], None]


class ControlClient:
    """The worker's end: one connection to its agent, read on a daemon thread.

    ``on_message`` runs on that thread for every message from the agent; ``None`` signals that
    the agent closed the connection.
    """

    def __init__(self, path: str, on_message: OnMessage) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._send_lock = threading.Lock()
        self._on_message = on_message
        self._thread = threading.Thread(target=self._read, name="elastrun-control", daemon=True)

    @classmethod
    def from_env(cls, on_message: OnMessage) -> ControlClient | None:
        """Connect to the agent named in ``ELASTRUN_CONTROL_SOCKET``; None outside elastrun."""
        path = os.environ.get(SOCKET_ENV)
        if not path:
            return None
        try:
            return cls(path, on_message)
        except OSError:
            return None

    def hello(self, local_rank: int) -> None:
        """Say who this worker is, then start reading the agent's messages."""
        self.send(Hello(pid=os.getpid(), local_rank=local_rank))
        self._thread.start()

    def send(self, message: ToAgent) -> bool:
        with self._send_lock:
            try:
                self._sock.sendall(encode(message))
            except OSError:
                return False
        return True

    def _read(self) -> None:
        lines = LineReader(TO_WORKER)
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._on_message(None)
                return
            for message in lines.feed(data):
                if isinstance(message, ProtocolError):
                    print(f"elastrun: this worker's agent sent a control message it does not understand: {message}; "
                          "leaving the control channel (this worker is restarted, not re-formed)", file=sys.stderr)
                    self.close()
                    self._on_message(None)
                    return
                self._on_message(message)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
