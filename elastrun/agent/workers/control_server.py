"""The agent's end of the control channel to the workers that opted in to in-process re-forms.

A worker started by elastrun finds ``ELASTRUN_CONTROL_SOCKET`` in its environment: a Unix
socket the agent listens on in its runtime directory.  A script that runs its training through
``elastrun.train.run`` connects and says hello; from then on the agent, instead of killing that
worker for a change elsewhere, asks it to leave its process group and waits for the new round's
environment (see docs/train.md, "In-process re-form").  Workers that never connect are handled
as before: killed and started again.

The messages are the dataclasses of :mod:`elastrun.shared.protocol`: ``Hello``, ``Paused``, ``Reformed``
and ``Failed`` from a worker, ``Pause`` and ``Assign`` to it.  A connection that sends anything
else (not JSON, an unknown type, a wrong field, a message before its ``Hello``) is refused: the
agent says why and closes it, and that worker is restarted instead of re-formed at the next change.

The agent side (:class:`ControlServer`) never blocks: it is pumped from the agent's ``select``
loop.  The worker side (:class:`elastrun.worker.control_client.ControlClient`) reads on a daemon
thread and hands messages to a callback, so a ``pause`` reaches a training thread that is
blocked in a collective.
"""

from __future__ import annotations

import abc
import select
import socket
import time
from pathlib import Path
from typing import TypeVar

from elastrun.shared import log
from elastrun.shared.protocol import TO_AGENT, Hello, LineReader, ProtocolError, ToAgent, ToWorker, encode

M = TypeVar("M", bound=ToAgent)
_log = log.get("agent")


class ControlChannel(abc.ABC):
    """What the agent's re-form session needs from the channel to its workers, addressed by PID.

    :class:`ControlServer` is the real one; a unit test may give the session a stand-in.  Example::

        if channel.connected(pid) and channel.send(pid, Pause()):
            answers = channel.wait_for([pid], (Paused, Failed), timeout=5.0)
    """

    #: Where workers connect (given to them as ``ELASTRUN_CONTROL_SOCKET``).
    path: Path

    @abc.abstractmethod
    def filenos(self) -> list[int]:
        """Descriptors to include in the agent's ``select``."""

    @abc.abstractmethod
    def pump(self, timeout: float = 0.0) -> None:
        """Take in what arrived, waiting at most ``timeout`` for something."""

    @abc.abstractmethod
    def connected(self, pid: int) -> bool:
        """Whether the worker with this PID said hello and is still connected."""

    @abc.abstractmethod
    def send(self, pid: int, message: ToWorker) -> bool:
        """Send one message to a worker; False if it is not connected (or the send failed)."""

    @abc.abstractmethod
    def take(self, pid: int, kind: type[M]) -> M | None:
        """Remove and return the oldest message of class ``kind`` from this worker, if any."""

    @abc.abstractmethod
    def wait_for(self, pids: list[int], kinds: tuple[type[ToAgent], ...], timeout: float) -> dict[int, ToAgent]:
        """Wait (bounded) until each worker sent one message of one of ``kinds`` or disconnected;
        the message by PID of those that answered."""

    @abc.abstractmethod
    def forget(self, pid: int) -> None:
        """Close the connection of a worker that is being killed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection and stop listening."""


class _Peer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines = LineReader(TO_AGENT)
        self.pid: int | None = None
        self.local_rank: int | None = None


class ControlServer(ControlChannel):
    """The agent's end: accepts workers' connections on a Unix socket, keeps each one's messages by PID."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._peers: dict[int, _Peer] = {}  # by descriptor
        #: Messages received from each hello'd worker (by PID), oldest first.
        self.inbox: dict[int, list[ToAgent]] = {}

    def filenos(self) -> list[int]:
        """Descriptors to include in the agent's ``select``."""
        return [self._listener.fileno(), *self._peers]

    def pump(self, timeout: float = 0.0) -> None:
        """Accept new connections and read what arrived, waiting at most ``timeout`` for something."""
        self._take_in(select.select(self.filenos(), [], [], timeout)[0])

    def _take_in(self, ready: list[int]) -> None:
        for fd in ready:
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._peers:
                self._read(self._peers[fd])

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            self._peers[sock.fileno()] = _Peer(sock)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        for message in peer.lines.feed(data):
            if isinstance(message, Hello):
                peer.pid = message.pid
                peer.local_rank = message.local_rank
                self.inbox[peer.pid] = []
            elif isinstance(message, ProtocolError) or peer.pid is None:
                self._refuse(peer, message if isinstance(message, ProtocolError)
                             else ProtocolError(f"{message.kind!r} message before the connection's 'hello'"))
                return
            else:
                self.inbox.setdefault(peer.pid, []).append(message)

    def _refuse(self, peer: _Peer, error: ProtocolError) -> None:
        who = "a worker" if peer.pid is None else f"worker {peer.pid} (local rank {peer.local_rank})"
        _log.warning(f"{who} sent a control message elastrun does not understand: {error}; closing its control "
                     "connection (it will be restarted, not re-formed, at the next change)")
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        self._peers.pop(peer.sock.fileno(), None)
        peer.sock.close()
        if peer.pid is not None:
            self.inbox.pop(peer.pid, None)

    def _peer(self, pid: int) -> _Peer | None:
        return next((p for p in self._peers.values() if p.pid == pid), None)

    def connected(self, pid: int) -> bool:
        """Whether the worker with this PID has said hello and is still connected."""
        return self._peer(pid) is not None

    def send(self, pid: int, message: ToWorker) -> bool:
        """Send one message to a worker; False if it is not connected (or the send failed)."""
        peer = self._peer(pid)
        if peer is None:
            return False
        data = encode(message)
        deadline = time.monotonic() + 2.0
        while data:
            try:
                sent = peer.sock.send(data)
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    return False
                select.select([], [peer.sock], [], 0.05)
                continue
            except OSError:
                self._drop(peer)
                return False
            data = data[sent:]
        return True

    def take(self, pid: int, kind: type[M]) -> M | None:
        """Remove and return the oldest message of class ``kind`` from this worker, if any."""
        box = self.inbox.get(pid, [])
        for i, message in enumerate(box):
            if isinstance(message, kind):
                return box.pop(i)  # type: ignore[return-value]
        return None

    def wait_for(self, pids: list[int], kinds: tuple[type[ToAgent], ...], timeout: float) -> dict[int, ToAgent]:
        """Wait (bounded) until each worker sent one message of one of ``kinds`` or disconnected.

        Returns the message by PID for those that answered; the others are missing.  What is in
        the sockets when the time is up is read before giving up: on a busy host the agent itself
        may not run for a while, and an answer that came in time counts even if it was not read
        in time.
        """
        deadline = time.monotonic() + timeout
        answers: dict[int, ToAgent] = {}
        last_look = False
        while True:
            for pid in pids:
                if pid in answers:
                    continue
                for kind in kinds:
                    message = self.take(pid, kind)
                    if message is not None:
                        answers[pid] = message
                        break
            waiting = [p for p in pids if p not in answers and self.connected(p)]
            if not waiting or last_look:
                return answers
            left = deadline - time.monotonic()
            if left > 0:
                self.pump(min(left, 0.05))
            else:
                last_look = True
                self._drain()

    def _drain(self) -> None:
        """Read everything the connections hold now, without waiting (bounded: the senders may go on)."""
        for _ in range(64):
            ready, _, _ = select.select(self.filenos(), [], [], 0.0)
            if not ready:
                return
            self._take_in(ready)

    def forget(self, pid: int) -> None:
        """Close the connection of a worker that is being killed."""
        peer = self._peer(pid)
        if peer is not None:
            self._drop(peer)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        self._listener.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
