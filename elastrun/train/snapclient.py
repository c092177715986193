"""The worker's side of the agents' snapshot servers: byte ranges of other nodes' snapshots, at wire speed.

Under elastrun every agent serves its node's snapshot directory (``elastrun/agent/snapserver.py``)
and tells its workers where (``ELASTRUN_SNAPSHOT_SERVER``) and, with a job token, where the key is
(``ELASTRUN_SNAPSHOT_KEY_FILE``).  A restore that needs bytes another node holds asks that node's
server for them with a :class:`SnapshotClient`: the requests are pipelined on one connection and
each answer is received straight into its destination (``recv_into`` a tensor's memory: no copy in
user space).  Without a server (another launcher) restores use the process group instead.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import dataclass, replace

import torch

from elastrun.shared import snapshot_wire as wire
from elastrun.shared.protocol import SNAPSHOT_KEY_ENV, SNAPSHOT_SERVER_ENV

#: Requests sent ahead of the answers being read (each is a small message).
WINDOW = 32
#: Connections one :func:`fetch` opens to a server, and the largest range each request asks for:
#: parallel streams spread the receiving side's work (copies out of the socket, first touches of
#: fresh destination pages) over the cores; one stream leaves them on one.
STREAMS = 4
PIECE = 16 << 20
CONNECT_TIMEOUT = 10.0
IO_TIMEOUT = 120.0


def my_server() -> str | None:
    """``host:port`` of this node's snapshot server, or None (not under an elastrun agent)."""
    return os.environ.get(SNAPSHOT_SERVER_ENV) or None


def job_key() -> bytes | None:
    """The job's snapshot key (None without a job token)."""
    path = os.environ.get(SNAPSHOT_KEY_ENV)
    if not path:
        return None
    with open(path) as f:
        return bytes.fromhex(f.read().strip())


def writable(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (the caller keeps ``t`` alive)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a snapshot range lands in a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


@dataclass
class Get:
    """One byte range of a snapshot data file on the server, and where it lands."""

    where: str  # "" (the node's own) or "replicas/<source>"
    name: str  # the slot: "shard.r1.2"
    meta_crc: int  # the generation of the file the plan saw
    offset: int
    nbytes: int
    into: memoryview


class SnapshotClient:
    """One authenticated connection to a snapshot server::

        with SnapshotClient("10.0.0.7:41235", job_key()) as client:
            errors = client.get([Get("", "shard.r1.2", crc, 0, n, writable(tensor))])
    """

    def __init__(self, address: str, key: bytes | None) -> None:
        self.address = address
        self.sock = socket.create_connection(wire.split_address(address), timeout=CONNECT_TIMEOUT)
        try:
            wire.tune(self.sock)
            self.sock.settimeout(IO_TIMEOUT)
            wire.client_handshake(self.sock, key, address)
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> SnapshotClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def meta(self, where: str, name: str) -> bytes:
        """The meta file of a slot (its header, for a reader that has none)."""
        wire.send_msg(self.sock, {"op": "get", "where": where, "name": name, "part": "meta"})
        head = wire.expect_ok(wire.recv_msg(self.sock), f"{self.address} {where}/{name}.meta")
        raw = wire.recv_exact(self.sock, int(head["nbytes"]))
        wire.expect_ok(wire.recv_msg(self.sock), f"{self.address} {where}/{name}.meta")
        return raw

    def get(self, gets: list[Get]) -> list[str | None]:
        """Fill every ``get.into``; for each, None or why it could not be had.  A broken connection
        fails every range not yet received (raised as :class:`~elastrun.shared.snapshot_wire.PeerError`)."""
        errors: list[str | None] = []
        sent = 0
        for i, g in enumerate(gets):
            while sent < len(gets) and sent < i + WINDOW:
                s = gets[sent]
                wire.send_msg(self.sock, {"op": "get", "where": s.where, "name": s.name, "part": "data",
                                          "meta_crc": s.meta_crc, "offset": s.offset, "nbytes": s.nbytes})
                sent += 1
            head = wire.recv_msg(self.sock)
            if head.get("ok") is not True:
                errors.append(f"{self.address}: {head.get('error') or 'refused'}")
                continue
            if head.get("nbytes") != g.nbytes:
                raise wire.PeerError(f"{self.address} answered {head.get('nbytes')} bytes for {g.nbytes}")
            wire.recv_into(self.sock, g.into)
            tail = wire.recv_msg(self.sock)
            errors.append(None if tail.get("ok") is True else f"{self.address}: {tail.get('error')}")
        return errors


def fetch(address: str, key: bytes | None, gets: list[Get], streams: int = STREAMS) -> list[str | None]:
    """Fill every ``get.into`` from the server at ``address`` over up to ``streams`` connections at
    once (ranges cut into pieces of at most :data:`PIECE` bytes, dealt out in turn); for each get,
    None or why it could not be had (a connection that fails fails the pieces it carried)."""
    pieces: list[tuple[int, Get]] = []
    for i, g in enumerate(gets):
        for lo in range(0, g.nbytes, PIECE) if g.nbytes else [0]:
            n = min(PIECE, g.nbytes - lo)
            pieces.append((i, replace(g, offset=g.offset + lo, nbytes=n, into=g.into[lo : lo + n])))
    lanes = [pieces[k :: max(1, streams)] for k in range(min(max(1, streams), len(pieces)))]
    errors: list[str | None] = [None] * len(gets)

    def run(lane: list[tuple[int, Get]]) -> None:
        try:
            with SnapshotClient(address, key) as client:
                results = client.get([g for _, g in lane])
        except OSError as e:  # PeerError too
            results = [f"{address}: {e}"] * len(lane)
        for (i, _), error in zip(lane, results, strict=True):
            if error is not None and errors[i] is None:
                errors[i] = error

    if len(lanes) == 1:
        run(lanes[0])
    else:
        threads = [threading.Thread(target=run, args=(lane,), daemon=True) for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return errors
