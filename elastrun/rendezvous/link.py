"""Liveness links: an agent process's death seen from its closed TCP connection, in milliseconds.

Heartbeats (:mod:`elastrun.rendezvous.keepalive`, etcd leases) notice a *silent* node after
``heartbeat_timeout``.  When an agent *process* dies (SIGKILL, OOM kill, segfault) the kernel
closes its sockets at once, so a peer that holds a connection to it can know within a round
trip.  Each agent therefore:

- listens on a TCP port on the address the other agents already reach it by (``NodeInfo.addr``)
  and publishes the port with its node info (``NodeInfo.link_port``, a join value, so sealed
  with the job token when there is one) before it joins a round;
- holds one connection to the node whose liveness it watches: its successor in the ring of
  group ranks (the same node whose heartbeat it watches).

When that connection closes without the peer's ``bye`` (sent to every connected watcher when an
agent closes its rendezvous handler: it finished, left or was stopped), the watcher connects
again at once to confirm:

- **refused**: nothing listens there any more, so the host is up and the process is gone.  The
  link calls ``on_dead(peer)``; the backend declares the node dead through its usual
  single-writer path (first writer wins), with the cause ``link``;
- accepted and answered by the same node: a transient drop; the link goes on;
- no answer within :data:`CONFIRM_TIMEOUT`, unreachable, or answered by someone else: the link
  says nothing.  Heartbeat silence decides, as for a partition or a stopped (SIGSTOP) process,
  whose connections stay open and whose listener still accepts.

A first connection that is refused counts the same (the peer listened before it joined, so a
refusal means it is gone: e.g. a node that died while its round was closing).

The handshake is one line each way (``\\n``-terminated), sealed like the job's store values
(``value#tag``, HMAC with the session key over ``<prefix>link/<peer>``) when there is a token::

    watcher -> peer:   hello <peer> <watcher> <nonce>
    peer -> watcher:   ok <peer> <watcher> <nonce>
    peer -> watcher:   bye <peer> <watcher> <nonce>      (when the peer closes)

Only a refused connection to the port in the peer's authentic node info declares a death, so a
client without the token cannot point a watcher at a closed port; it can neither complete a
handshake (the listener drops it) nor forge a ``bye`` (which would only leave the death to
heartbeat silence anyway).  An attacker who can forge packets on the path between two nodes can
fake a refusal; the same attacker can drop the packets and get the node declared dead by
silence, so the link gives it nothing new.

One thread per agent (``elastrun-link``) serves the listener, the connections of its watchers
and its own outgoing link through one selector; :meth:`Link.close` says ``bye``, closes every
socket and joins the thread.
"""

from __future__ import annotations

import errno
import hmac
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from elastrun.rendezvous.api import Member, NodeInfo

#: How long a confirming reconnection may take before the link leaves the verdict to heartbeat silence.
CONFIRM_TIMEOUT = 1.0
#: How long a handshake (either side) may take.
HANDSHAKE_TIMEOUT = 5.0
#: Most watcher connections held at once (normally one; more during a ring change).
MAX_INBOUND = 64
#: A connection reset before the handshake completes is tried again, this often, this many times: a
#: process being torn down closes its sockets one by one, so its listener may still take a
#: connection that its exit resets a moment later.
RETRY_DELAY = 0.01
MAX_RETRIES = 50
_LINE_MAX = 1024


class Sealer(Protocol):
    """What the link needs of the job's authenticator (:class:`~elastrun.rendezvous.auth.JobAuth` or ``NoAuth``)."""

    prefix: str

    def seal(self, key: str, value: str | bytes) -> str | bytes: ...


def _line(auth: Sealer, kind: str, peer: str, watcher: str, nonce: str) -> bytes:
    sealed = auth.seal(f"{auth.prefix}link/{peer}", f"{kind} {peer} {watcher} {nonce}")
    return (sealed if isinstance(sealed, bytes) else sealed.encode()) + b"\n"


def _parse_hello(line: bytes) -> tuple[str, str, str] | None:
    """(peer, watcher, nonce) named by a hello line, before its tag is checked."""
    text = line.decode(errors="replace").rpartition("#")[0] or line.decode(errors="replace")
    parts = text.split(" ")
    if len(parts) != 4 or parts[0] != "hello":
        return None
    return parts[1], parts[2], parts[3]


@dataclass
class _Outgoing:
    """The watcher's side: one connection to the watched peer."""

    peer: str
    addr: str
    port: int
    sock: socket.socket | None = None
    #: connect → hello (hello sent, awaiting ok) → linked; retry: reset during the handshake, connect
    #: again soon; done: dead, bye, or left to heartbeat silence.
    phase: str = "connect"
    confirming: bool = False
    retries: int = 0
    nonce: str = ""
    deadline: float | None = None
    buf: bytes = b""
    #: Why the link ended (phase done): what a test or a debugger reads when no death was declared.
    why: str = ""


@dataclass
class _Incoming:
    """The watched side: one connection from a watcher."""

    deadline: float | None
    phase: str = "hello"
    bye: bytes = b""
    buf: bytes = b""


class Link:
    """This agent's listener plus its one outgoing link; see the module docstring.

    ``auth`` returns the job's current sealer (it can change when an etcd job starts a new
    incarnation); ``on_dead(peer)`` is called from the link's thread when the watched peer's
    process is gone, at most once per :meth:`watch` target.
    """

    def __init__(self, addr: str, node_id: str, auth: Callable[[], Sealer], on_dead: Callable[[str], None]) -> None:
        self.node_id = node_id
        self._auth = auth
        self._on_dead = on_dead
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        self._listener = socket.socket(family, kind, proto)
        try:
            self._listener.bind(sockaddr)
            self._listener.listen(MAX_INBOUND)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        #: The port watchers connect to (published as ``NodeInfo.link_port``).
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wanted: tuple[str, str, int] | None = None
        self._out: _Outgoing | None = None
        self._inbound: dict[socket.socket, _Incoming] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="elastrun-link", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the handler
    @property
    def linked(self) -> str | None:
        """The peer this link holds an established, answered connection to (None: none now)."""
        out = self._out
        return out.peer if out is not None and out.phase == "linked" else None

    def watch(self, peer: str | None, addr: str = "", port: int = 0) -> None:
        """Hold a link to ``peer`` at ``addr:port`` (None or port 0: no outgoing link).  Cheap when unchanged."""
        wanted = (peer, addr, port) if peer and port else None
        with self._lock:
            if wanted == self._wanted or self._stopping:
                return
            self._wanted = wanted
        self._wake()

    def close(self) -> None:
        """Say ``bye`` to the watchers, close every socket and stop the thread (idempotent)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _run(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while True:
                with self._lock:
                    stopping, wanted = self._stopping, self._wanted
                if stopping:
                    break
                self._retarget(wanted)
                for key, _mask in self._sel.select(self._timeout()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            while self._wake_r.recv(256):
                                pass
                        except OSError:
                            pass
                    elif key.data == "out":
                        self._on_outgoing()
                    else:
                        self._on_incoming(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            self._shutdown()

    def _timeout(self) -> float | None:
        deadlines = [c.deadline for c in self._inbound.values() if c.deadline is not None]
        if self._out is not None and self._out.deadline is not None:
            deadlines.append(self._out.deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for sock, conn in list(self._inbound.items()):
            if conn.deadline is not None and now >= conn.deadline:
                self._drop_incoming(sock)
        out = self._out
        if out is not None and out.deadline is not None and now >= out.deadline:
            if out.phase == "retry":
                self._connect(out)
            else:
                wait = CONFIRM_TIMEOUT if out.confirming else HANDSHAKE_TIMEOUT  # heartbeat silence decides
                self._finish(out, "done", f"no answer within {wait:g} s ({out.phase})")

    # ------------------------------------------------------------------ outgoing (watcher side)
    def _retarget(self, wanted: tuple[str, str, int] | None) -> None:
        out = self._out
        if out is not None and wanted == (out.peer, out.addr, out.port):
            return
        if out is not None:
            self._finish(out, "done", "watching another peer")
            self._out = None
        if wanted is not None:
            self._out = _Outgoing(*wanted)
            self._connect(self._out)

    def _connect(self, out: _Outgoing) -> None:
        try:
            family, kind, proto, _, sockaddr = socket.getaddrinfo(out.addr, out.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
        except OSError:
            self._finish(out, "done", "no socket to the peer's address")
            return
        sock.setblocking(False)
        out.sock, out.phase, out.buf = sock, "connect", b""
        out.deadline = time.monotonic() + (CONFIRM_TIMEOUT if out.confirming else HANDSHAKE_TIMEOUT)
        err = sock.connect_ex(sockaddr)
        if err in (0, errno.EINPROGRESS):
            self._sel.register(sock, selectors.EVENT_WRITE, "out")
        elif err == errno.ECONNREFUSED:
            self._declare(out)
        else:
            self._finish(out, "done", f"connect failed: {errno.errorcode.get(err, err)}")

    def _on_outgoing(self) -> None:
        out = self._out
        if out is None or out.sock is None:
            return
        if out.phase == "connect":
            err = out.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == errno.ECONNREFUSED:
                self._declare(out)
                return
            if err in (errno.ECONNRESET, errno.ECONNABORTED):
                self._retry(out)
                return
            if err != 0:
                # unreachable, timed out: heartbeat silence decides
                self._finish(out, "done", f"connect failed: {errno.errorcode.get(err, err)}")
                return
            out.nonce = secrets.token_hex(8)
            try:
                out.sock.send(_line(self._auth(), "hello", out.peer, self.node_id, out.nonce))
            except OSError:
                self._finish(out, "done", "the hello could not be sent")
                return
            out.phase = "hello"
            self._sel.modify(out.sock, selectors.EVENT_READ, "out")
            return
        try:
            data = out.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if out.phase == "linked":
                # Closed without a bye: find out at once whether the process is still there.
                self._close_out(out)
                out.confirming = True
                self._connect(out)
            else:
                self._retry(out)  # closed during the handshake: a dying listener, or not ours
            return
        out.buf += data
        while b"\n" in out.buf:
            line, _, out.buf = out.buf.partition(b"\n")
            auth = self._auth()
            if hmac.compare_digest(line + b"\n", _line(auth, "bye", out.peer, self.node_id, out.nonce)):
                self._finish(out, "done", "bye")  # a graceful exit: not a death
                return
            if out.phase == "hello":
                if not hmac.compare_digest(line + b"\n", _line(auth, "ok", out.peer, self.node_id, out.nonce)):
                    self._finish(out, "done", "another process answered on that port")
                    return
                out.phase, out.deadline, out.confirming, out.retries = "linked", None, False, 0
        if len(out.buf) > _LINE_MAX:
            self._finish(out, "done", "an overlong line")

    def _retry(self, out: _Outgoing) -> None:
        """Connect again shortly; after :data:`MAX_RETRIES` resets in a row, leave it to heartbeat silence."""
        if out.retries >= MAX_RETRIES:
            self._finish(out, "done", f"reset {MAX_RETRIES} times in a row")
            return
        out.retries += 1
        self._close_out(out)
        out.phase, out.deadline = "retry", time.monotonic() + RETRY_DELAY

    def _declare(self, out: _Outgoing) -> None:
        self._finish(out, "done", "dead: refused")
        try:
            self._on_dead(out.peer)
        except Exception:  # the handler reports its own store errors; the link must keep serving
            pass

    def _close_out(self, out: _Outgoing) -> None:
        if out.sock is not None:
            try:
                self._sel.unregister(out.sock)
            except (KeyError, ValueError):
                pass
            out.sock.close()
            out.sock = None

    def _finish(self, out: _Outgoing, phase: str, why: str) -> None:
        self._close_out(out)
        out.phase, out.deadline, out.why = phase, None, why

    # ------------------------------------------------------------------ incoming (watched side)
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._inbound) >= MAX_INBOUND:
                sock.close()
                continue
            sock.setblocking(False)
            self._inbound[sock] = _Incoming(deadline=time.monotonic() + HANDSHAKE_TIMEOUT)
            self._sel.register(sock, selectors.EVENT_READ, "in")

    def _on_incoming(self, sock: socket.socket, closing: bool = False) -> None:
        conn = self._inbound.get(sock)
        if conn is None:
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_incoming(sock)
            return
        if conn.phase == "held":
            return  # a watcher sends nothing after its hello
        conn.buf += data
        if b"\n" not in conn.buf:
            if len(conn.buf) > _LINE_MAX:
                self._drop_incoming(sock)
            return
        line = conn.buf.partition(b"\n")[0] + b"\n"
        named = _parse_hello(line[:-1])
        auth = self._auth()
        if named is None or named[0] != self.node_id or \
                not hmac.compare_digest(line, _line(auth, "hello", self.node_id, named[1], named[2])):
            self._drop_incoming(sock)  # not a watcher of this job, or not of this node
            return
        conn.bye = _line(auth, "bye", self.node_id, named[1], named[2])
        try:
            sock.send(conn.bye if closing else _line(auth, "ok", self.node_id, named[1], named[2]))
        except OSError:
            self._drop_incoming(sock)
            return
        conn.phase, conn.deadline, conn.buf = "held", None, b""

    def _drop_incoming(self, sock: socket.socket) -> None:
        self._inbound.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    # ------------------------------------------------------------------ clean shutdown
    def _shutdown(self) -> None:
        """Answer pending hellos with bye, say bye to every held watcher, close everything."""
        try:
            self._accept()
            for sock in list(self._inbound):
                conn = self._inbound[sock]
                if conn.phase == "hello":
                    self._on_incoming(sock, closing=True)
                elif conn.bye:
                    try:
                        sock.send(conn.bye)
                    except OSError:
                        pass
        finally:
            for sock in list(self._inbound):
                self._drop_incoming(sock)
            if self._out is not None:
                self._close_out(self._out)
            self._sel.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()


def listen_for_watchers(node: NodeInfo, auth: Callable[[], Sealer], on_dead: Callable[[str], None],
                        warn: Callable[..., None]) -> Link | None:
    """A :class:`Link` listening on ``node.addr``, its port put in ``node.link_port`` (call before joining).

    Where nothing can listen on that address the node goes without a link (its death is then
    noticed from heartbeat silence only), which ``warn`` reports once.
    """
    try:
        link = Link(node.addr, node.node_id, auth, on_dead)
    except OSError as exc:
        warn(f"no liveness link on {node.addr} ({exc}); this node's death will be noticed from heartbeat "
             "silence only", kind="link")
        node.link_port = 0
        return None
    node.link_port = link.port
    return link


def ring_successor(ring: list[Member], me: str, gone: set[str]) -> Member | None:
    """The first member after ``me`` in ``ring`` (ordered by group rank) that is not in ``gone``."""
    ids = [m.node_id for m in ring]
    if me not in ids or len(ring) < 2:
        return None
    at = ids.index(me)
    for step in range(1, len(ring)):
        member = ring[(at + step) % len(ring)]
        if member.node_id not in gone:
            return member
    return None
