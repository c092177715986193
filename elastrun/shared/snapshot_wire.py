"""The snapshot server's wire protocol: framing, the handshake and the requests.

Every control message is a JSON object sent as a 4-byte big-endian length and the UTF-8 text
(:func:`send_msg`, :func:`recv_msg`); raw bytes follow a message that announces them
(``"nbytes"``).  A connection begins with the handshake, then carries any number of requests, each
answered in order (a client may send several before reading the answers)::

    client                                             server
    {"hello": PROTOCOL, "nonce": nc, "auth": bool} -->
                                                   <-- {"nonce": ns, "proof": H(key, "server", nc, ns)}
    {"proof": H(key, "client", ns, nc)}            -->
                                                   <-- {"ok": true}
    {"op": "get", "where": "", "name": "shard.r1.2", "part": "data", "meta_crc": c,
     "offset": o, "nbytes": n}                     -->
                                                   <-- {"ok": true, "nbytes": n}, n bytes, {"ok": true}

``H`` is HMAC-SHA256 with the job's snapshot key (derived from the job token and the run id by the
agent; workers read it from the file named by ``ELASTRUN_SNAPSHOT_KEY_FILE``).  Both sides prove
that they hold the key over the other side's fresh nonce, so neither the key nor a replayable
value crosses the wire.  Without a job token there is no key: the server answers ``{"ok": true}``
to the hello at once (and listens on its agent's own address only).  A failed check is answered
with ``{"error": "..."}`` and the connection is closed.

A ``get`` names a file of the server's snapshot directory by where it is (``""``, or
``replicas/<source node>``), its slot name and part (``data``, ``meta``), and the CRC of the
meta file the client saw (the file's generation: a slot rewritten since is refused).  The bytes are
followed by a trailer saying whether the file was still the same generation once they were sent.
A ``put`` (agent to agent, :mod:`elastrun.agent.replicator`) carries a replica: header, bytes,
then a trailer with the sender's block CRCs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
from typing import Any

PROTOCOL = "elastrun-snapshot/1"
#: The longest control message accepted (a push's header carries the meta file, base64).
MAX_MESSAGE = 64 << 20
#: Seconds a server gives a new connection to complete its handshake.
HANDSHAKE_TIMEOUT = 5.0
#: Socket buffers asked for on both sides (the kernel may give less).
SOCKET_BUFFER = 4 << 20

#: Slot names a request may name (no path: the server joins them to its directory).
_NAME = re.compile(r"(shard|dcp)\.r\d{1,9}\.\d{1,3}|shared\.\d{1,3}")
#: A source node's name in ``replicas/<source>`` (an agent's node id).
_SOURCE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


class PeerError(OSError):
    """A snapshot server or client refused, or the connection broke; the message says which and why."""


def valid_name(name: Any) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def valid_source(source: Any) -> bool:
    return isinstance(source, str) and _SOURCE.fullmatch(source) is not None


def valid_where(where: Any) -> bool:
    """``""`` (the node's own snapshots) or ``replicas/<source>``."""
    if where == "":
        return True
    return isinstance(where, str) and where.startswith("replicas/") and valid_source(where[len("replicas/"):])


def tune(sock: socket.socket) -> None:
    """Large buffers and no Nagle delay: requests are small, answers large."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


# ------------------------------------------------------------------------------------- framing
def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (zero copy: the kernel writes into it)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise PeerError(f"connection closed after {got} of {n} bytes")
        got += k


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_MESSAGE:
        raise PeerError(f"a message of {n} bytes (more than {MAX_MESSAGE}): not a snapshot server peer")
    try:
        obj = json.loads(recv_exact(sock, n))
    except ValueError:
        raise PeerError("a message that is not JSON: not a snapshot server peer") from None
    if not isinstance(obj, dict):
        raise PeerError("a message that is not a JSON object: not a snapshot server peer")
    return obj


def expect_ok(msg: dict[str, Any], what: str) -> dict[str, Any]:
    """``msg`` if it says ok, else :class:`PeerError` with the server's reason."""
    if msg.get("ok") is not True:
        raise PeerError(f"{what}: {msg.get('error') or 'refused'}")
    return msg


# ------------------------------------------------------------------------------------- handshake
def _proof(key: bytes, side: bytes, mine: str, theirs: str) -> str:
    return hmac.new(key, side + b"\0" + mine.encode() + b"\0" + theirs.encode(), hashlib.sha256).hexdigest()


def client_handshake(sock: socket.socket, key: bytes | None, where: str) -> None:
    """Prove the key to the server at ``where`` and check its proof; :class:`PeerError` otherwise."""
    nonce = secrets.token_hex(16)
    send_msg(sock, {"hello": PROTOCOL, "nonce": nonce, "auth": key is not None})
    reply = recv_msg(sock)
    if "error" in reply:
        raise PeerError(f"snapshot server {where} refused the connection: {reply['error']}")
    if reply.get("ok") is True and key is None:
        return
    if key is None or reply.get("ok") is True:
        raise PeerError(f"snapshot server {where}: job token mismatch (this side has "
                        f"{'a' if key else 'no'} token, the server {'none' if key else 'one'})")
    theirs = reply.get("nonce")
    if not isinstance(theirs, str) or not hmac.compare_digest(str(reply.get("proof")),
                                                              _proof(key, b"server", nonce, theirs)):
        raise PeerError(f"snapshot server {where} could not prove the job token: another job, or not elastrun")
    send_msg(sock, {"proof": _proof(key, b"client", theirs, nonce)})
    expect_ok(recv_msg(sock), f"snapshot server {where}")


def server_handshake(sock: socket.socket, key: bytes | None) -> None:
    """The server's side: :class:`PeerError` (after telling the client why) unless the client
    speaks this protocol and, with a key, proves it."""
    hello = recv_msg(sock)
    if hello.get("hello") != PROTOCOL or not isinstance(hello.get("nonce"), str):
        send_msg(sock, {"error": f"expected a {PROTOCOL} hello"})
        raise PeerError("a client that does not speak the snapshot protocol")
    if key is None:
        if hello.get("auth"):
            send_msg(sock, {"error": "this job runs without a job token; the client has one"})
            raise PeerError("a client with a job token (this job has none)")
        send_msg(sock, {"ok": True})
        return
    if not hello.get("auth"):
        send_msg(sock, {"error": "this snapshot server requires the job token"})
        raise PeerError("a client without the job token")
    nonce = secrets.token_hex(16)
    send_msg(sock, {"nonce": nonce, "proof": _proof(key, b"server", hello["nonce"], nonce)})
    answer = recv_msg(sock)
    if not hmac.compare_digest(str(answer.get("proof")), _proof(key, b"client", nonce, hello["nonce"])):
        send_msg(sock, {"error": "authentication failed"})
        raise PeerError("a client that could not prove the job token")
    send_msg(sock, {"ok": True})


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
